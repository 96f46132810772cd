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
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.causal_lm.documents import hold_out
from app.tasks.causal_lm.models import flops_per_token, load_lm_tokenizer, load_model, model_source
from app.tasks.causal_lm.stream import READ_AHEAD
from app.tasks.causal_lm.task import CausalLMTask, token_losses
from app.tasks.sft.attention import check_isolation, model_inputs, use_eager_attention
from app.tasks.sft.chunked import chunking_holds, losses_from_head, shifted_targets
from app.tasks.sft.config import DataFormat, SFTConfig, TrainOn
from app.tasks.sft.conversations import BadRow, Fields
from app.tasks.sft.packing import PackedRows, SFTCollator
from app.tasks.sft.spans import SpanFinder, UnusableTemplate
from app.tasks.sft.stream import ConversationStream, first_records
from app.tasks.sft.templates import install_chat_template
from app.tasks.sft.tokens import Recipe, encode_rows, first_error, tokenize_split
from app.tasks.text.sources import Split, check_data_files, load_dataset_splits, read_file
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
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._explicit_mask = runtime.static_shapes
        fixed = self.cfg.block_size if self.cfg.packing or runtime.static_shapes else None
        lengths = None if self.cfg.packing or self.cfg.streaming else [len(ids) for ids in train["input_ids"]]
        return TaskData(train=train, eval=evaluation, collate_fn=SFTCollator(pad if pad is not None else 0, fixed),
                        train_lengths=lengths)

    def _prepare(self) -> tuple[Any, Any]:
        """Both splits read, checked, tokenized with their labels (cached), held out and packed."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = self._read(root / "raw")
        train = splits["train"]
        try:
            self.data_format = Fields.of(cfg).detect(train.data.column_names, cfg.format, train.origin)
        except BadRow as err:
            raise ConfigError(f"{err}") from None
        if self.data_format is DataFormat.messages or (self.data_format is DataFormat.prompt_completion
                                                       and isinstance(train.data[0][cfg.prompt_field], list)):
            self._check_template()
        summaries = []
        rows = {}
        for name, split in splits.items():
            data, dropped, cut = tokenize_split(split, name, self.tokenizer, cfg, self.data_format, root)
            rows[name] = Split(data, digest(split.fingerprint, "sft-rows"), split.origin)
            summaries.append((name, split, dropped, cut))
        held_out = "validation" not in rows
        if held_out:
            rows["train"], rows["validation"] = hold_out(rows["train"], cfg.eval_fraction, cfg.split_seed)
        for name in ("train", "validation"):
            if len(rows[name].data) == 0:
                raise ConfigError(f"{rows[name].origin} has no conversation with a token to learn "
                                  f"(task.train_on={cfg.train_on.value}).")
        train_rows, eval_rows = rows["train"].data, rows["validation"].data
        self._prompts = sample_prompts(eval_rows, cfg.sample_prompts)
        self._splits_read = [self._describe(*summary) for summary in summaries]
        if held_out:
            self._splits_read.append(f"evaluation: {len(eval_rows):,} of them held out (task.eval_fraction="
                                     f"{cfg.eval_fraction}, task.split_seed={cfg.split_seed})")
        if cfg.packing:
            packed_train, packed_eval = PackedRows(train_rows, cfg.block_size), PackedRows(eval_rows, cfg.block_size)
            self._splits_read.append(f"packed: {len(train_rows):,} training conversations into {len(packed_train):,} "
                                     f"rows of {cfg.block_size} tokens, {len(eval_rows):,} evaluation ones into "
                                     f"{len(packed_eval):,}")
            return packed_train, packed_eval
        return train_rows, eval_rows

    def _streamed(self) -> tuple[ConversationStream, Any]:
        """The training file as a stream of rows (``stream.ConversationStream``); evaluation: the
        validation file, else the file's first ``task.eval_documents`` records (held out of the stream)."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        assert cfg.data_files.train is not None  # the schema's check for streaming
        path = Path(cfg.data_files.train).expanduser()
        evaluation, begin, first = self._stream_start(path, root)
        try:
            self.data_format = Fields.of(cfg).detect(list(first[0]), cfg.format, str(path))
        except BadRow as err:
            raise ConfigError(f"{err}") from None
        if self.data_format is DataFormat.messages or (self.data_format is DataFormat.prompt_completion
                                                       and isinstance(first[0].get(cfg.prompt_field), list)):
            self._check_template()
        eval_rows, dropped, cut = tokenize_split(evaluation, "validation", self.tokenizer, cfg, self.data_format,
                                                 root)
        if len(eval_rows) == 0:
            raise ConfigError(f"{evaluation.origin} has no conversation with a token to learn "
                              f"(task.train_on={cfg.train_on.value}).")
        self._prompts = sample_prompts(eval_rows, cfg.sample_prompts)
        recipe = StreamRecipe(self.data_format, Fields.of(cfg), cfg.train_on, cfg.block_size, cfg.overlong, str(path),
                              True)
        stream = ConversationStream(path, begin, functools.partial(encode_records, tokenizer=self.tokenizer,
                                                                   recipe=recipe), cfg.block_size, cfg.packing)
        after = " after the evaluation records" if begin else ""
        streamed = (f"train: streamed from {path} ({path.stat().st_size - begin:,} bytes{after}, learnt: "
                    f"{cfg.train_on.value}), read while training; rows with nothing to learn left out")
        self._splits_read = [streamed, self._describe("validation", evaluation, dropped, cut)]
        if cfg.packing:
            packed_eval = PackedRows(eval_rows, cfg.block_size)
            self._splits_read.append(f"packed: each {READ_AHEAD} streamed conversations into rows of {cfg.block_size} "
                                     f"tokens, {len(eval_rows):,} evaluation ones into {len(packed_eval):,}")
            return stream, packed_eval
        return stream, eval_rows

    def _stream_start(self, path: Path, root: Path) -> tuple[Split, int, list[dict[str, Any]]]:
        """A streamed run's evaluation split and the byte where its stream begins
        (:meth:`_streamed_evaluation`), and the file's first record (in a list), which says its columns."""
        evaluation, begin = self._streamed_evaluation(path, root)
        first = first_records(path, 1)[0]
        if not first:
            raise ConfigError(f"{path} holds no record.")
        return evaluation, begin, first

    def _streamed_evaluation(self, path: Path, root: Path) -> tuple[Split, int]:
        """A streamed run's evaluation split: the validation file, else the training file's first
        ``task.eval_documents`` records (held out of the stream); and the byte where the stream begins."""
        import datasets

        cfg = self.cfg
        if cfg.data_files.validation is not None:
            return read_file(cfg.data_files.validation, "validation", root / "raw"), 0
        held, begin = first_records(path, cfg.eval_documents)
        if len(held) < cfg.eval_documents or begin >= path.stat().st_size:
            raise ConfigError(f"{path} has {len(held)} record(s), too few to hold out task.eval_documents="
                              f"{cfg.eval_documents} for evaluation and stream the rest; give "
                              "task.data_files.validation or a smaller task.eval_documents.")
        return Split(datasets.Dataset.from_list(held), digest(json.dumps(held, sort_keys=True)),
                     f"{path} (its first {len(held)} records)"), begin

    def _read(self, raw_cache: Path) -> dict[str, Split]:
        cfg = self.cfg
        if cfg.data_files.train is not None:
            files = {"train": cfg.data_files.train, "validation": cfg.data_files.validation}
            return {split: read_file(path, split, raw_cache) for split, path in files.items() if path is not None}
        assert cfg.dataset is not None  # the schema's check
        return load_dataset_splits(cfg.dataset, cfg.dataset_config, None, ["train", "validation"])

    def _check_template(self) -> None:
        """Conversational data needs a usable template: the tokenizer's own must exist, and the spans of
        a probe conversation must be found (else one sentence, before any row is tokenized)."""
        source = self.cfg.tokenizer or model_source(self.cfg)
        if self.cfg.chat_template is None:
            install_chat_template(self.tokenizer, None, source)  # checks that the tokenizer has its own
        try:
            self.end_of_turn = SpanFinder(self.tokenizer, TrainOn.assistant).end_of_turn()
        except UnusableTemplate as err:
            raise ConfigError(f"The chat template of {self.cfg.chat_template or source} cannot be trained on: {err}; "
                              "give task.chat_template=chatml or a Jinja file.") from None
        except BadRow as err:
            raise ConfigError(f"The chat template of {self.cfg.chat_template or source} fails on a two-turn "
                              f"conversation: {err}.") from None

    def _describe(self, name: str, split: Split, dropped: int, cut: int) -> str:
        """``train: 120 conversations of chat.jsonl (messages, learnt: assistant), 2 dropped with nothing to
        learn, 3 cut at task.block_size=256``."""
        assert self.data_format is not None
        kind = {DataFormat.messages: "conversations", DataFormat.prompt_completion: "prompt/completion pairs",
                DataFormat.text: "texts"}[self.data_format]
        text = f"{name}: {len(split.data):,} {kind} of {split.origin} (learnt: {self.cfg.train_on.value})"
        if dropped:
            text += f", {dropped:,} dropped with nothing to learn"
        if cut:
            text += f", {cut:,} {'dropped as' if self.cfg.overlong.value == 'drop' else 'cut at'} longer than " \
                    f"task.block_size={self.cfg.block_size}"
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


class StreamRecipe(Recipe):
    """A streamed file's rows are named by their byte offset (a stream that seeks does not count lines)."""

    def where(self, index: int) -> str:
        return f"{self.origin}, the line at byte {index},"


def encode_records(records: list[dict[str, Any]], offsets: list[int], tokenizer: PreTrainedTokenizerBase,
                   recipe: Recipe) -> list[dict[str, list[int]]]:
    """Streamed records -> training rows, as the map-style split's (``tokens.encode_rows``): a bad record
    refused naming its byte offset, records with nothing learnt left out."""
    keys = list(dict.fromkeys(key for record in records for key in record))
    out = encode_rows({key: [record.get(key) for record in records] for key in keys}, offsets, tokenizer, recipe)
    first_error(out)
    return [{"input_ids": ids, "labels": labels}
            for ids, labels, learnt in zip(out["input_ids"], out["labels"], out["learnt"], strict=True) if learnt > 0]
