"""``SFTTask``: instruction tuning. ``task=causal_lm``'s model, tokenizer, export and summed evaluation,
on conversations or prompt/completion pairs formatted by a chat template, the loss on the learnt
tokens only (``task.train_on``), one conversation per row or packed without cross-attention.

The loss is per learnt token over the whole optimizer step (``StepOutput(sample_losses,
sample_items)``): a long answer's tokens weigh what a short one's do, at any batch split.
Evaluation sums per process (``app.tasks.base.SummedMetrics``): ``eval/loss`` and ``eval/perplexity``
per learnt token and ``eval/token_accuracy``, with no logits gathered.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.causal_lm.models import flops_per_token, load_lm_tokenizer, load_model, model_source
from app.tasks.causal_lm.stream import READ_AHEAD, LineStream
from app.tasks.causal_lm.task import CausalLMTask, token_losses
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.bad_rows import Skipped, as_records, from_records, judge
from app.tasks.sft.chunked import chunking_holds, losses_from_head, shifted_targets
from app.tasks.sft.config import BadRows, DataFormat, SFTConfig, TrainOn
from app.tasks.sft.conversations import BadRow, Fields
from app.tasks.sft.packing import PackedRows, SFTCollator
from app.tasks.sft.records import SAMPLE, Places, parsed, read_records, records_split, sample_records
from app.tasks.sft.spans import SpanFinder, TemplateTraits, UnusableTemplate
from app.tasks.sft.stream import ConversationStream, first_records, scan
from app.tasks.sft.templates import install_chat_template
from app.tasks.sft.tokens import (
    Recipe,
    Tokenized,
    bad_records,
    encode_texts,
    hold_out_sources,
    sources,
    tokenize_split,
)
from app.tasks.text.sources import Split, check_data_files, load_dataset_splits
from app.tasks.text.task import digest, run_main_first
from app.tasks.text.tokenization import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class SFTTask(CausalLMTask):
    metric_names = ("loss", "perplexity", "token_accuracy")
    _loss_chunk = 0
    """``task.loss_chunk`` once :func:`chunking_holds` for the built model (``build_model``), else 0: the
    plain loss (also for a task made without ``__init__``, as the TRL conformance test makes one)."""

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.cfg: SFTConfig = cfg
        self.data_format: DataFormat | None = None
        self.end_of_turn: str | None = None
        """The token that ends an assistant turn (the export's generation stops there too)."""
        self.fields: Fields | None = None
        """The columns read (``task.*_field``; ShareGPT's ``conversations`` where ``messages`` is absent)."""
        self.spans_from: str | None = None
        """How the learnt spans are found (the log's data line): the template's generation markers, or its rendering."""
        self._skipped: list[Skipped] = []
        self._stream_recipe: Recipe | None = None
        self._explicit_mask = False
        self._prompts: list[tuple[list[int], list[int]]] = []
        """``task.sample_prompts``: the first evaluation conversations' prompts and their learnt answers."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            source = self.cfg.tokenizer or model_source(self.cfg)
            tokenizer = load_lm_tokenizer(self.cfg)
            if not tokenizer.is_fast:
                raise ConfigError(f"the tokenizer of {source} is a slow (Python) one; task=sft needs a fast tokenizer "
                                  "(tokenizer.json), whose character offsets locate the learnt tokens.")
            if self.cfg.chat_template is not None:
                install_chat_template(tokenizer, self.cfg.chat_template, source)
            self._tokenizer = tokenizer
        return self._tokenizer

    # -- data ----------------------------------------------------------------------------------------------

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        check_data_files(self.cfg.data_files)
        if not runtime.is_main_process:
            import datasets

            datasets.disable_progress_bars()
        train, evaluation = run_main_first(runtime, self._streamed if self.cfg.streaming else self._prepare)
        if isinstance(train, ConversationStream):
            assert self._stream_recipe is not None  # _streamed made it
            self._check_stream(runtime, train, functools.partial(bad_records, tokenizer=self.tokenizer,
                                                                 recipe=self._stream_recipe))
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._explicit_mask = runtime.static_shapes
        fixed = self.cfg.block_size if self.cfg.packing or runtime.static_shapes else None
        lengths = None if self.cfg.packing or self.cfg.streaming else [len(ids) for ids in train["input_ids"]]
        return TaskData(train=train, eval=evaluation, collate_fn=SFTCollator(pad if pad is not None else 0, fixed),
                        train_lengths=lengths)

    def skipped_rows(self) -> list[dict[str, Any]]:
        """The bad rows left out (``task.bad_rows=skip``), as ``<run>/skipped_rows.jsonl`` lists them."""
        return [bad.record() for bad in self._skipped]

    def _prepare(self) -> tuple[Any, Any]:
        """Both splits read, checked, tokenized with their labels (cached), held out and packed."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = self._read(root / "raw")
        train, _ = splits["train"]
        traits = self._detect(sample_records(train.data), train.origin)
        rows, self._splits_read = {}, []
        for name, (split, places) in splits.items():
            tokenized = self._tokenize_rows(split, places, name, traits, root)
            rows[name] = Split(tokenized.rows, digest(split.fingerprint, "sft-rows"), split.origin)
            self._splits_read.append(self._describe(name, tokenized))
        held_out = "validation" not in rows
        if held_out:
            rows["train"], rows["validation"] = hold_out_sources(rows["train"], cfg.eval_fraction, cfg.split_seed)
        for name in ("train", "validation"):
            if len(rows[name].data) == 0:
                raise ConfigError(f"{rows[name].origin} has no conversation with a token to learn "
                                  f"(task.train_on={cfg.train_on.value}).")
        train_rows, eval_rows = rows["train"].data, rows["validation"].data
        self._prompts = sample_prompts(eval_rows, cfg.sample_prompts)
        if held_out:
            self._splits_read.append(f"evaluation: {sources(eval_rows):,} of them held out (task.eval_fraction="
                                     f"{cfg.eval_fraction}, task.split_seed={cfg.split_seed})")
        if cfg.packing:
            packed_train, packed_eval = PackedRows(train_rows, cfg.block_size), PackedRows(eval_rows, cfg.block_size)
            self._splits_read.append(f"packed: {sources(train_rows):,} training conversations into "
                                     f"{len(packed_train):,} rows of {cfg.block_size} tokens, {sources(eval_rows):,} "
                                     f"evaluation ones into {len(packed_eval):,}")
            return packed_train, packed_eval
        return train_rows, eval_rows

    def _tokenize_rows(self, split: Split, places: Places, name: str, traits: TemplateTraits | None,
                  root: Path) -> Tokenized:
        """A split's rows, its bad rows judged (``task.bad_rows``) and kept for ``skipped_rows.jsonl``."""
        assert self.data_format is not None and self.fields is not None  # _detect ran
        tokenized = tokenize_split(split, places, name, self.tokenizer, self.cfg, self.data_format, self.fields,
                                   traits, root)
        self._judge(tokenized.bad, tokenized.read, places.origin)
        return tokenized

    def _judge(self, bad: list[Skipped], read: int, origin: str) -> None:
        judge(bad, read, origin, self.cfg.bad_rows is BadRows.skip, self.cfg.max_bad_fraction)
        self._skipped.extend(bad)

    def _detect(self, sample: list[dict[str, Any]], origin: str) -> TemplateTraits | None:
        """The data's format and columns (``self.data_format``, ``self.fields``) from a sample of its records;
        for conversations, the chat template's traits (a template that cannot be trained on refused here,
        before any row is read)."""
        columns = list(dict.fromkeys(key for record in sample for key in record))
        self.fields = Fields.of(self.cfg).with_messages(columns)
        try:
            self.data_format = self.fields.detect(columns, self.cfg.format, origin)
        except BadRow as err:
            raise ConfigError(f"{err}") from None
        self.cfg.check_data_format(self.data_format, origin)
        if self.cfg.max_prompt_length is not None and self.data_format is not DataFormat.prompt_completion:
            raise ConfigError(f"task.max_prompt_length cuts the prompt of prompt/completion data, and {origin} holds "
                              f"{self.data_format.value} data; leave it null.")
        conversational = self.data_format is DataFormat.messages or (
            self.data_format is DataFormat.prompt_completion and sample
            and any(isinstance(sample[0].get(f), list) for f in (self.fields.prompt, self.fields.completion)))
        return self._check_template() if conversational else None

    def _streamed(self) -> tuple[ConversationStream, Any]:
        """The training file as a stream of rows (``stream.ConversationStream``); evaluation: the
        validation file, else the file's first ``task.eval_documents`` records (held out of the stream)."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        assert cfg.data_files.train is not None  # the schema's check for streaming
        path = Path(cfg.data_files.train).expanduser()
        (evaluation, places), begin, sample = self._stream_start(path, root)
        traits = self._detect(sample, str(path))
        tokenized = self._tokenize_rows(evaluation, places, "validation", traits, root)
        eval_rows = tokenized.rows
        if len(eval_rows) == 0:
            raise ConfigError(f"{evaluation.origin} has no conversation with a token to learn "
                              f"(task.train_on={cfg.train_on.value}).")
        self._prompts = sample_prompts(eval_rows, cfg.sample_prompts)
        assert self.data_format is not None and self.fields is not None
        self._stream_recipe = Recipe(self.data_format, self.fields, cfg.train_on, cfg.block_size, cfg.overlong,
                                     Places(str(path), "byte"), traits)
        stream = ConversationStream(path, begin, functools.partial(encode_texts, tokenizer=self.tokenizer,
                                                                   recipe=self._stream_recipe),
                                    cfg.block_size, cfg.packing)
        after = " after the evaluation records" if begin else ""
        streamed = (f"train: streamed from {path} ({path.stat().st_size - begin:,} bytes{after}, learnt: "
                    f"{cfg.train_on.value}), read while training; rows with nothing to learn left out")
        self._splits_read = [streamed, self._describe("validation", tokenized)]
        if cfg.packing:
            packed_eval = PackedRows(eval_rows, cfg.block_size)
            self._splits_read.append(f"packed: each {READ_AHEAD} streamed conversations into rows of {cfg.block_size} "
                                     f"tokens, {sources(eval_rows):,} evaluation ones into {len(packed_eval):,}")
            return stream, packed_eval
        return stream, eval_rows

    def _check_stream(self, runtime: TaskRuntime, stream: LineStream,
                      check: Callable[[list[str], list[int]], list[Skipped]]) -> None:
        """A streamed file's bad rows (``check``: a read-ahead's records -> the bad ones), found before training
        (each process reads its part of the file once), judged as a map-style file's (``task.bad_rows``); the
        stream then leaves them out as it meets them."""
        read, bad = scan(stream, runtime.process_index, runtime.num_processes, check)
        parts = runtime.gather_object([(read, as_records(bad))])
        read = sum(n for n, _ in parts)
        found = [b for _, records in parts for b in from_records(records)]
        self._judge(found, read, str(stream.path))
        self._splits_read[0] = self._splits_read[0].replace(", read while training", f", {read:,} records, read "
                                                            "while training") + (
            f"; {len(found):,} bad row(s) skipped (skipped_rows.jsonl)" if found else "")

    def _stream_start(self, path: Path, root: Path) -> tuple[tuple[Split, Places], int, list[dict[str, Any]]]:
        """A streamed run's evaluation split and the byte where its stream begins
        (:meth:`_streamed_evaluation`), and a sample of the file's first records, which says its columns."""
        evaluation, begin = self._streamed_evaluation(path, root)
        texts = first_records(path, SAMPLE)[0]
        sample = parsed(texts)
        if not sample:
            raise ConfigError(f"{path} holds no record" + (" that is a JSON object in its first lines." if texts else "."))
        return evaluation, begin, sample

    def _streamed_evaluation(self, path: Path, root: Path) -> tuple[tuple[Split, Places], int]:
        """A streamed run's evaluation split: the validation file, else the training file's first
        ``task.eval_documents`` records (held out of the stream); and the byte where the stream begins."""
        cfg = self.cfg
        if cfg.data_files.validation is not None:
            return read_records(cfg.data_files.validation, "validation", root / "raw"), 0
        texts, offsets, begin = first_records(path, cfg.eval_documents)
        if len(texts) < cfg.eval_documents or begin >= path.stat().st_size:
            raise ConfigError(f"{path} has {len(texts)} record(s), too few to hold out task.eval_documents="
                              f"{cfg.eval_documents} for evaluation and stream the rest; give "
                              "task.data_files.validation or a smaller task.eval_documents.")
        origin = f"{path} (its first {len(texts)} records)"
        return (records_split(texts, offsets, origin, digest(*texts)), Places(str(path), "byte")), begin

    def _read(self, raw_cache: Path) -> dict[str, tuple[Split, Places]]:
        cfg = self.cfg
        if cfg.data_files.train is not None:
            files = {"train": cfg.data_files.train, "validation": cfg.data_files.validation}
            return {split: read_records(path, split, raw_cache) for split, path in files.items() if path is not None}
        assert cfg.dataset is not None  # the schema's check
        loaded = load_dataset_splits(cfg.dataset, cfg.dataset_config, None, ["train", "validation"])
        return {name: (split, Places(split.origin, "row")) for name, split in loaded.items()}

    def _check_template(self) -> TemplateTraits:
        """Conversational data needs a usable template: the tokenizer's own must exist, and the spans of
        a probe conversation must be found (else one sentence, before any row is tokenized)."""
        source = self.cfg.tokenizer or model_source(self.cfg)
        if self.cfg.chat_template is None:
            install_chat_template(self.tokenizer, None, source)  # checks that the tokenizer has its own
        finder = SpanFinder(self.tokenizer, TrainOn.assistant)
        try:
            traits = finder.probe()
        except UnusableTemplate as err:
            raise ConfigError(f"The chat template of {self.cfg.chat_template or source} cannot be trained on: {err}; "
                              "give task.chat_template=chatml or a Jinja file.") from None
        except BadRow as err:
            raise ConfigError(f"The chat template of {self.cfg.chat_template or source} fails on a two-turn "
                              f"conversation: {err}.") from None
        self.end_of_turn = traits.end_of_turn
        self.spans_from = ("the template's generation markers" if finder.template.has_markers
                           else "the template's rendering, turn by turn")
        return traits

    def _describe(self, name: str, t: Tokenized) -> str:
        """``train: 120 conversations of chat.jsonl (messages, learnt: assistant), 4 bad rows skipped, 2 dropped
        with nothing to learn, 3 cut at task.block_size=256; learnt spans: ...``, each row counted once."""
        assert self.data_format is not None
        cfg = self.cfg
        kind = {DataFormat.messages: "conversations", DataFormat.prompt_completion: "prompt/completion pairs",
                DataFormat.text: "texts"}[self.data_format]
        text = f"{name}: {t.kept:,} {kind} of {t.origin} (learnt: {cfg.train_on.value})"
        for count, what in ((len(t.bad), "bad row(s) skipped (skipped_rows.jsonl)"),
                            (t.prompt_cut, (f"with their prompt cut to task.max_prompt_length={cfg.max_prompt_length} "
                                           f"({cfg.truncation_mode.value})")),
                            (t.dropped, "dropped with nothing to learn"),
                            (t.too_long, f"dropped as longer than task.block_size={cfg.block_size}"),
                            (t.cut, f"cut at task.block_size={cfg.block_size}")):
            text += f", {count:,} {what}" if count else ""
        if self.spans_from is not None and cfg.train_on is not TrainOn.all:
            text += f"; learnt spans from {self.spans_from}"
            if self.spans_from.endswith("markers"):
                text += (f" (the span finder places {t.disagreements:,} turn(s) otherwise)" if t.disagreements
                         else " (the span finder agrees)")
            if t.own_rows:
                text += (f"; {t.own_rows:,} with turns the template rewrites once later turns follow, each such turn "
                         "trained in a row of its own")
        return text

    # -- model and steps -----------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = load_model(self.cfg, self.tokenizer, grow_vocabulary=True)
        self._flops_per_token = flops_per_token(model, self.cfg.block_size)
        if self._explicit_mask:
            use_eager_attention(model)
        if self.cfg.packing:
            check_isolation(model, self._explicit_mask)
        chunk = self.cfg.loss_chunk
        self._loss_chunk = chunk if chunk and chunking_holds(model, chunk) else 0
        if chunk and not self._loss_chunk:
            logger.warning("%s changes its logits after its output layer: the loss is computed on the whole "
                           "block's logits at once (task.loss_chunk is not used).", type(model).__name__)
        return model

    def _forward(self, model: nn.Module, batch: Any, hits: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each position's loss (0 where nothing is learnt), its target, and (``hits``) whether the argmax
        is the target; by chunks of ``task.loss_chunk`` positions unless the plain loss is in use."""
        dtype = model.get_input_embeddings().weight.dtype if self._explicit_mask else torch.float32  # type: ignore[operator]
        inputs = model_inputs(batch, self._explicit_mask, dtype)
        if self._loss_chunk:
            with losses_from_head(model, batch["labels"], self._loss_chunk):
                out = model(**inputs, use_cache=False).logits
            return out[..., 0], shifted_targets(batch["labels"]), out[..., 1].detach() if hits else None
        logits = model(**inputs, use_cache=False).logits
        losses, targets = token_losses(logits, batch["labels"])
        return losses, targets, (logits.argmax(dim=-1) == targets) if hits else None

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Per row, the summed loss of its learnt tokens and their number (the engine normalises by the
        learnt tokens of the whole optimizer step)."""
        losses, targets, _ = self._forward(model, batch)
        return StepOutput(sample_losses=losses.sum(dim=1), sample_items=(targets != IGNORE_INDEX).sum(dim=1))

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per row: the summed loss of its learnt tokens, their count, and how many the model predicts
        exactly (argmax), all on the device."""
        losses, targets, hits = self._forward(model, batch, hits=True)
        assert hits is not None
        learnt = targets != IGNORE_INDEX
        correct = (hits.bool() & learnt).sum(dim=1)
        return {"loss_sum": losses.sum(dim=1), "tokens": learnt.sum(dim=1), "correct": correct}

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        metrics = super().metrics_from_sums(sums)
        return {**metrics, "token_accuracy": sums.get("correct", 0.0) / max(sums["tokens"], 1)}

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums`)."""
        totals = logits.double().sum(dim=0).tolist()
        return self.metrics_from_sums(dict(zip(("loss_sum", "tokens", "correct"), totals, strict=False)))

    # -- samples -------------------------------------------------------------------------------------------

    def evaluation_samples(self, model: nn.Module, device: torch.device) -> list[dict[str, str]]:
        """``task.sample_prompts``: each prompt (an evaluation conversation up to its first learnt token),
        completed greedily up to ``task.max_new_tokens`` or the end of the turn, and the answer it was
        trained towards."""
        if not self._prompts:
            return []
        tokenizer = self.tokenizer
        stops = [t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(self.end_of_turn)
                             if self.end_of_turn is not None else None) if isinstance(t, int)]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
        rows = []
        with torch.no_grad():
            for prompt, answer in self._prompts:
                ids = torch.tensor([prompt], device=device)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),  # type: ignore[operator]
                                     max_new_tokens=self.cfg.max_new_tokens, do_sample=False,
                                     eos_token_id=stops or None, pad_token_id=pad)
                rows.append({"prompt": str(tokenizer.decode(prompt)),
                             "completion": str(tokenizer.decode(out[0, len(prompt):])),
                             "reference": str(tokenizer.decode(answer))})
        return rows

    # -- export and card -----------------------------------------------------------------------------------

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """causal_lm's export (the tokenizer, with the run's chat template), and generation that stops at
        the end-of-turn token as well as at EOS."""
        generation = getattr(model, "generation_config", None)
        if generation is not None and self.end_of_turn is not None:
            token = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
            eos = generation.eos_token_id
            ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            if token not in ids:
                generation.eos_token_id = [*ids, token] if ids else token
        super().save_artifacts(model, folder)

    def _card_of_prompts(self, kind: str, conversational: bool) -> dict[str, str]:
        """The model card's base model, data (``kind``: what its rows are) and, for conversations, chat template:
        what the tasks built on this one (the preference tasks, grpo) say first."""
        cfg = self.cfg
        facts = {"base model": f"`{model_source(cfg)}`", "data": f"`{cfg.data_files.train or cfg.dataset or ''}` "
                 f"({kind}{', conversations' if conversational else ''})"}
        if conversational:
            facts["chat template"] = f"{cfg.chat_template or 'the tokenizer’s own'}, saved with the tokenizer"
        return facts

    def card_facts(self) -> dict[str, str]:
        cfg = self.cfg
        data = cfg.data_files.train or cfg.dataset or ""
        template = cfg.chat_template or "the tokenizer's own"
        facts = {"base model": f"`{model_source(cfg)}`", "data": f"`{data}`"
                 + (f" ({self.data_format.value})" if self.data_format is not None else "")}
        if self.data_format is not DataFormat.text:
            facts["chat template"] = f"{template}, saved with the tokenizer (end of turn: `{self.end_of_turn}`)"
        facts["trained on"] = f"{cfg.train_on.value} tokens" + (", packed" if cfg.packing else "")
        return facts



def sample_prompts(rows: Any, count: int) -> list[tuple[list[int], list[int]]]:
    """The first ``count`` rows that have a prompt: each row's tokens before its first learnt one, and its
    first run of learnt tokens (the answer, its end-of-turn token included)."""
    prompts: list[tuple[list[int], list[int]]] = []
    for index in range(len(rows)):
        if len(prompts) >= count:
            break
        row = rows[index]
        ids, labels = list(row["input_ids"]), list(row["labels"])
        first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
        if not first:  # nothing learnt, or learnt from the first token: no prompt
            continue
        end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE_INDEX), len(labels))
        prompts.append((ids[:first], ids[first:end]))
    return prompts
