"""``DPOTask``: preference tuning. ``task=sft``'s model, tokenizer, chat template and export, on pairs of
a chosen and a rejected answer to the same prompt; the loss (``task.loss_type``) compares the policy's
answer log-probabilities with the reference's (``task.reference``, see ``reference.py``).

Each batch holds its pairs' chosen rows, then their rejected rows, padded together: one forward pass
gives both, so they see the same weights (and dropout state). With ``task.packing=true`` a row holds
whole pairs, each side a sequence of its own (``packing.py``); a row is then one of the engine's samples,
its loss the sum over its pairs and its items their count. A pair is one item of the engine's loss
(``StepOutput(sample_losses=per pair, sample_items=1)``): the loss is the mean over the pairs of the
whole optimizer step, at any batch split. Evaluation sums TRL's metrics per pair on each process and
reduces them (``app.tasks.base.SummedMetrics``): ``eval/loss``, ``eval/rewards/chosen``,
``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``;
training logs the same six over each logging window's pairs (``train/rewards/chosen``...:
``StepOutput.sample_metrics``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.documents import hold_out
from app.tasks.causal_lm.models import flops_per_token, load_model
from app.tasks.dpo.config import DPOConfig, Reference
from app.tasks.dpo.loss import answer_logps, preference_losses, segment_logps
from app.tasks.dpo.packing import PackedPairCollator, PackedPairs, per_pair_values, per_row
from app.tasks.dpo.pairs import (
    COUNTS,
    SIDES,
    PairFields,
    bad_pairs,
    conversational,
    encode_pairs,
    pair_features,
)
from app.tasks.dpo.reference import AdaptersDisabled, FrozenCopy, Precomputed
from app.tasks.dpo.stream import PairStream
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.bad_rows import skipped_of
from app.tasks.sft.packing import SFTCollator
from app.tasks.sft.records import Places, sample_records
from app.tasks.sft.task import SFTTask
from app.tasks.text.sources import Split, check_data_files
from app.tasks.text.task import digest, run_main_first
from app.tasks.text.tokenization import cache_root, tokenizer_fingerprint

if TYPE_CHECKING:
    import datasets

CACHE_VERSION = 4
"""Part of the cache key: bump it when ``encode_pairs`` changes what it produces."""
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


class PairCollator:
    """Pairs into one batch: the chosen rows, then the rejected rows (``SFTCollator``: padded on the
    right, -100 labels, an attention mask where lengths differ), and each pair's values besides
    (``packing.per_pair_values``: its row number ``pair``, a reward model's ``margin``)."""

    def __init__(self, pad_id: int, fixed_length: int | None = None):
        self.rows = SFTCollator(pad_id, fixed_length)

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.rows([{"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]}
                           for side in SIDES for p in pairs])
        return {**batch, **per_pair_values(pairs)}


class DPOTask(SFTTask):
    metric_names: tuple[str, ...] = ("loss", *METRICS)  # type: ignore[assignment]

    def __init__(self, cfg: DPOConfig, reference_free: bool = False):
        super().__init__(cfg)
        self.cfg: DPOConfig = cfg
        self.conversational = False
        self.reference_free = reference_free
        """No reference model is made or run (a task built on these pairs that has none: task=reward_model)."""
        self._runtime: TaskRuntime | None = None
        """``build_data``'s runtime: ``build_model`` prepares the reference copy with it."""
        self.reference: FrozenCopy | AdaptersDisabled | Precomputed | None = \
            AdaptersDisabled() if not reference_free and cfg.reference is Reference.base else None

    # -- data ----------------------------------------------------------------------------------------------

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        check_data_files(self.cfg.data_files)
        if not runtime.is_main_process:
            import datasets

            datasets.disable_progress_bars()
        self._runtime = runtime  # build_model prepares the reference copy with it
        train, evaluation, key = run_main_first(runtime, self._pairs_streamed if self.cfg.streaming else self._pairs_read)
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pad = pad if pad is not None else 0
        self._explicit_mask = runtime.static_shapes
        collate = PairCollator(pad, self.cfg.block_size if runtime.static_shapes else None)
        stream = train if isinstance(train, PairStream) else None
        if stream is not None:
            self._check_stream(runtime, stream, functools.partial(bad_pairs, tokenizer=tokenizer, fields=stream.fields))
        if not self.reference_free and self.cfg.reference is Reference.precomputed:  # pair by pair, packed or not
            self.reference = Precomputed(key, (evaluation,) if stream else (train, evaluation), collate,
                                         self.cfg.reference_batch_size, runtime, stream)
            runtime.register_for_checkpointing(self.reference)
        if self.cfg.packing:  # map-style only (the schema refuses packing with streaming)
            packed_train, packed_eval = PackedPairs(train, self.cfg.block_size), PackedPairs(evaluation, self.cfg.block_size)
            self._splits_read.append(f"packed: {len(train):,} training pairs into {len(packed_train):,} rows of "
                                     f"{packed_train.capacity} tokens (2 × task.block_size), {len(evaluation):,} "
                                     f"evaluation ones into {len(packed_eval):,}")
            fixed = packed_train.capacity if runtime.static_shapes else None
            return TaskData(train=packed_train, eval=packed_eval, collate_fn=PackedPairCollator(pad, fixed))
        lengths = None if stream else [max(len(c), len(r))
                                       for c, r in zip(train["chosen_ids"], train["rejected_ids"], strict=True)]
        return TaskData(train=train, eval=evaluation, collate_fn=collate, train_lengths=lengths)

    def _pairs_streamed(self) -> tuple[PairStream, datasets.Dataset, str]:
        """The training file as a stream of pairs (``stream.PairStream``, each named by its line's byte
        offset); evaluation: the validation file, else the file's first ``task.eval_documents`` records
        (held out of the stream), named -1, -2… Also returns a key of the pairs."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        assert cfg.data_files.train is not None  # the schema's check for streaming
        path = Path(cfg.data_files.train).expanduser()
        (evaluation, places), begin, sample = self._stream_start(path, root)
        self._check_columns(list(dict.fromkeys(key for record in sample for key in record)), str(path))
        if conversational(sample[0], cfg.prompt_field, cfg.chosen_field):
            self.conversational = True
            self._check_template()
        data, fitted = self._tokenize(evaluation, places, "validation", root)
        size = path.stat().st_size
        after = " after the evaluation records" if begin else ""
        self._splits_read = [
            (f"train: streamed from {path} ({size - begin:,} bytes{after}, "
             f"{'conversations' if self.conversational else 'text'}), read while training"),
            f"validation: {len(data):,} pairs of {evaluation.origin}{fitted}"]
        fields = self._pair_fields(Places(str(path), "byte"))
        return (PairStream(path, begin, self.tokenizer, fields),
                data.add_column("pair", [-(k + 1) for k in range(len(data))]),
                digest(path.name, str(size), str(begin), evaluation.fingerprint))

    def _pair_fields(self, places: Places) -> PairFields:
        """The columns a split's pairs are read from, and how they are fitted (a task built on this one may
        read more: task=reward_model's margins)."""
        return PairFields.of(self.cfg, places)

    def _check_columns(self, columns: list[str], origin: str) -> None:
        cfg = self.cfg
        missing = [c for c in (cfg.chosen_field, cfg.rejected_field) if c not in columns]
        if missing:
            raise ConfigError(f"{origin} has no {' or '.join(repr(c) for c in missing)} column (it has "
                              f"{', '.join(columns)}); task={cfg.name} reads prompt/chosen/rejected pairs: set "
                              "task.prompt_field, task.chosen_field and task.rejected_field.")

    def _pairs_read(self) -> tuple[datasets.Dataset, datasets.Dataset, str]:
        """Both splits read, checked, tokenized (cached), held out; each pair numbered (training pairs
        first) for the precomputed reference table. Also returns a key of the pairs."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = self._read(root / "raw")
        train, _ = splits["train"]
        sample = sample_records(train.data)
        self._check_columns(list(dict.fromkeys(key for record in sample for key in record)), train.origin)
        if sample and conversational(sample[0], cfg.prompt_field, cfg.chosen_field):
            self.conversational = True
            self._check_template()
        rows, read = {}, []
        for name, (split, places) in splits.items():
            data, fitted = self._tokenize(split, places, name, root)
            rows[name] = Split(data, digest(split.fingerprint, "dpo-rows"), split.origin)
            read.append(f"{name}: {len(data):,} pairs of {split.origin}"
                        f" ({'conversations' if self.conversational else 'text'})"
                        + fitted)
        if "validation" not in rows:
            rows["train"], rows["validation"] = hold_out(rows["train"], cfg.eval_fraction, cfg.split_seed)
            read.append(f"evaluation: {len(rows['validation'].data):,} of them held out (task.eval_fraction="
                        f"{cfg.eval_fraction}, task.split_seed={cfg.split_seed})")
        self._splits_read = read
        train_rows, eval_rows = rows["train"].data, rows["validation"].data
        train_rows = train_rows.add_column("pair", list(range(len(train_rows))))
        eval_rows = eval_rows.add_column("pair", list(range(len(train_rows), len(train_rows) + len(eval_rows))))
        return train_rows, eval_rows, digest(rows["train"].fingerprint, rows["validation"].fingerprint)

    def _tokenize(self, split: Split, places: Places, name: str, root: Path) -> tuple[datasets.Dataset, str]:
        """The split's pairs (cached), its bad ones judged (``task.bad_rows``) and the dropped ones left out, and
        what was skipped, cut and dropped, for the log."""
        cfg = self.cfg
        fields = self._pair_fields(places)
        read = [fields.prompt, fields.chosen, fields.rejected, fields.tools, *([fields.margin] if fields.margin else [])]
        payload = {"version": CACHE_VERSION, "tokenizer": tokenizer_fingerprint(self.tokenizer),
                   "template": self.tokenizer.chat_template, "fields": read,
                   "fit": asdict(fields.fit), "data": split.fingerprint}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
        root.mkdir(parents=True, exist_ok=True)
        data = split.data.map(functools.partial(encode_pairs, tokenizer=self.tokenizer, fields=fields), batched=True,
                              with_indices=True, remove_columns=split.data.column_names, new_fingerprint=key,
                              num_proc=cfg.num_proc if len(split.data) >= 2 * cfg.num_proc > 2 else None,
                              desc=f"Tokenizing {cfg.name} {name}",
                              features=pair_features(fields.margin is not None), cache_file_name=str(root / f"dpo-{name}-{key}.arrow"),
                              load_from_cache_file=True)
        bad = skipped_of(data, places)
        self._judge(bad, len(data), places.origin)
        counts = {count: sum(data[count]) for count in COUNTS}
        if counts["dropped"] or bad:
            data = data.select([i for i, (dropped, error) in enumerate(zip(data["dropped"], data["error"], strict=True))
                                if not dropped and not error])
        skipped = f", {len(bad):,} bad row(s) skipped (skipped_rows.jsonl)" if bad else ""
        return data.remove_columns([*COUNTS, "error", "place", "raw"]), skipped + self._fitted(counts)

    def _fitted(self, counts: dict[str, int]) -> str:
        """``, 3 with their prompt cut (task.max_prompt_length=64, keep_end), 1 with an answer cut at
        task.block_size=128, 2 dropped as longer than task.block_size=128``: each pair counted once in each."""
        cfg = self.cfg
        to = f"task.max_prompt_length={cfg.max_prompt_length}" if cfg.max_prompt_length is not None \
            else f"to half of task.block_size={cfg.block_size}"
        said = [f"{counts['prompt_cut']:,} with their prompt cut ({to}, {cfg.truncation_mode.value})"
                if counts["prompt_cut"] else "",
                f"{counts['answer_cut']:,} with an answer cut at task.block_size={cfg.block_size}"
                if counts["answer_cut"] else "",
                f"{counts['dropped']:,} dropped as longer than task.block_size={cfg.block_size} (task.overlong=drop)"
                if counts["dropped"] else ""]
        return "".join(f", {part}" for part in said if part)

    # -- model and steps -----------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = load_model(self.cfg, self.tokenizer, grow_vocabulary=True)
        self._flops_per_token = flops_per_token(model, self.cfg.block_size)
        if self._explicit_mask:
            use_eager_attention(model)  # before the copy: the reference runs the same attention
        if self.cfg.packing:
            check_isolation(model, self._explicit_mask)
        if self.cfg.reference is Reference.copy and self.reference is None:
            # Before any adapter: the starting weights. Once: an adapter's export rebuilds the model on
            # the main process alone, and preparing a copy under FSDP2 takes every process.
            if self._runtime is None:
                raise RuntimeError("build_data() keeps the runtime that prepares the reference copy; call it first.")
            self.reference = FrozenCopy(model, self._runtime)
        return model

    def _logps(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Each side's summed answer log-probability and answer length, chosen sides first (packed or not)."""
        dtype = model.get_input_embeddings().weight.dtype if self._explicit_mask else torch.float32  # type: ignore[operator]
        logits = model(**model_inputs(batch, self._explicit_mask, dtype), use_cache=False).logits
        if "segment" in batch:
            return segment_logps(logits, batch["labels"], batch["segment"], 2 * len(batch["pair"]))
        return answer_logps(logits, batch["labels"])

    def _reference_logps(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self._logps(model, batch)[0]

    def _pairs(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per pair: the loss and TRL's metrics (one forward of the policy over both sides)."""
        policy, lengths = self._logps(model, batch)
        assert self.reference is not None  # build_data / build_model chose it
        reference = self.reference(model, batch, self._reference_logps)
        cfg = self.cfg
        return preference_losses(policy.view(2, -1), reference.view(2, -1).to(policy.dtype), lengths.view(2, -1),
                                 cfg.beta, cfg.label_smoothing, cfg.loss_type)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Each pair's loss; a pair is one item of the step's mean. TRL's metrics per pair too: the engine
        logs their means over the logging window's pairs (``train/rewards/accuracies``...), as evaluation does.
        Packed, a row is the engine's sample: its pairs' sums, and their count as its items."""
        losses, metrics = self._pairs(model, batch)
        if "pair_row" in batch:
            pairs = per_row(torch.ones_like(losses, dtype=torch.int64), batch)
            return StepOutput(sample_losses=per_row(losses, batch), sample_items=pairs,
                              sample_metrics={name: per_row(values, batch) for name, values in metrics.items()})
        return StepOutput(sample_losses=losses, sample_items=1, sample_metrics=metrics)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        losses, metrics = self._pairs(model, batch)
        sums = {"loss": losses.detach(), **metrics, "pairs": torch.ones_like(losses)}
        return {name: per_row(values, batch) for name, values in sums.items()}

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        return {name: sums[name] / pairs for name in self.metric_names}

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums`); from gathered rows of the same
        quantities, in ``metric_names`` order then the pair count, it gives the same metrics."""
        totals = logits.double().sum(dim=0).tolist()
        return self.metrics_from_sums(dict(zip((*self.metric_names, "pairs"), totals, strict=False)))

    def card_facts(self) -> dict[str, str]:
        cfg = self.cfg
        facts = self._card_of_prompts("preference pairs", self.conversational)
        facts["trained on"] = (f"{cfg.loss_type.value} preference loss, β = {cfg.beta}, reference: "
                               f"{cfg.reference.value}")
        return facts
