"""``CausalLMTask``: next-token prediction with any ``AutoModelForCausalLM`` on documents of text.

Data: the documents of each split (``documents.load_documents``), an evaluation split held out of
train when there is none, tokenized with an EOS after each document and packed into blocks, once,
on the main process first, and cached; or, with ``task.streaming``, the training file read as a
stream (``stream.LineStream``) whose evaluation split is a validation file or the file's first
``task.eval_documents`` documents. Evaluation sums token losses and token counts per process
(:class:`app.tasks.base.SummedMetrics`): ``eval/loss`` is the mean loss per predicted token,
``eval/perplexity`` its exponential.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from app.config import ConfigError
from app.tasks.base import StepOutput, TaskData, TaskRuntime
from app.tasks.causal_lm.batches import IGNORE_INDEX, LMCollator
from app.tasks.causal_lm.config import CausalLMConfig
from app.tasks.causal_lm.documents import encode_documents, hold_out, load_documents, tokenize_split
from app.tasks.causal_lm.models import flops_per_token, load_lm_tokenizer, load_model, model_source
from app.tasks.causal_lm.stream import LineReader, LineStream, first_documents
from app.tasks.text.sources import Split, check_data_files
from app.tasks.text.task import digest, run_main_first
from app.tasks.text.tokenization import cache_root

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


class CausalLMTask:
    metric_names: tuple[str, ...] = ("loss", "perplexity")

    def __init__(self, cfg: CausalLMConfig):
        cfg.check()  # also when built from a config that did not pass through app.launching.validate
        self.cfg = cfg
        self.name = cfg.name
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._flops_per_token: float | None = None
        self._splits_read: list[str] = []
        """What build_data read and made of it, per split: the log's (app.tasks.base.DescribesData)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_lm_tokenizer(self.cfg)
        return self._tokenizer

    # -- data ----------------------------------------------------------------------------------------------

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        check_data_files(self.cfg.data_files)  # on every process alike, before any of them waits for another
        if self.cfg.packing and self.tokenizer.eos_token_id is None:
            source = self.cfg.tokenizer or model_source(self.cfg)
            raise ConfigError(f"the tokenizer of {source} has no EOS token, so packed documents would run into each "
                              "other with nothing between them; give a tokenizer that has one (eos_token in its "
                              "tokenizer_config.json, e.g. tokenizer.eos_token = '</s>' before save_pretrained), or "
                              "task.packing=false (one document per row).")
        if not runtime.is_main_process:
            import datasets

            datasets.disable_progress_bars()  # "Tokenizing ..." shows once, from the main process
        train, evaluation = run_main_first(runtime, self._streamed if self.cfg.streaming else self._cached)
        if len(evaluation) == 0:
            raise ConfigError(f"the evaluation documents make no block of task.block_size={self.cfg.block_size} "
                              "tokens; give more of them or a smaller task.block_size.")
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Packed blocks have one shape; single documents are padded, to block_size where shapes must be fixed (XLA).
        fixed = self.cfg.block_size if runtime.static_shapes and not self.cfg.packing else None
        lengths = None if self.cfg.packing or self.cfg.streaming else [len(ids) for ids in train["input_ids"]]
        return TaskData(train=train, eval=evaluation, collate_fn=LMCollator(pad if pad is not None else 0, fixed),
                        train_lengths=lengths)

    def _cached(self) -> tuple[datasets.Dataset, datasets.Dataset]:
        """Every split read, a held-out one when there is no validation split, then tokenized and packed."""
        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        splits = load_documents(cfg, root / "raw")
        train, evaluation = splits["train"], splits.get("validation")
        if evaluation is None:
            train, evaluation = hold_out(train, cfg.eval_fraction, cfg.split_seed)
        rows = tokenize_split(train, "train", self.tokenizer, cfg, root, cfg.name)
        if len(rows) == 0:
            raise ConfigError(f"{train.origin} makes no training block of task.block_size={cfg.block_size} tokens; "
                              "give more text or a smaller task.block_size.")
        evaluation_rows = tokenize_split(evaluation, "validation", self.tokenizer, cfg, root, cfg.name)
        self._splits_read = [self._split_read("train", train, rows),
                             self._split_read("evaluation", evaluation, evaluation_rows)]
        return rows, evaluation_rows

    def _split_read(self, name: str, split: Split, rows: datasets.Dataset) -> str:
        """``train: 135 documents of corpus.txt -> 104 blocks of 32 tokens (3,328 tokens)``; one document
        per row: its rows and tokens, the documents cut at block_size and those without text."""
        documents, block = len(split.data), self.cfg.block_size
        if self.cfg.packing:
            return (f"{name}: {documents:,} documents of {split.origin} -> {len(rows):,} blocks of {block} tokens "
                    f"({len(rows) * block:,} tokens)")
        lengths = [len(ids) for ids in rows["input_ids"]]
        cut, empty = sum(length >= block for length in lengths), documents - len(rows)
        return (f"{name}: {documents:,} documents of {split.origin} -> {len(rows):,} rows, {sum(lengths):,} tokens "
                f"({cut:,} cut at task.block_size={block}" + (f", {empty:,} without text skipped)" if empty else ")"))

    def data_summary(self) -> list[str]:
        """Each split's documents, and the blocks (or rows) and tokens made of them."""
        return self._splits_read

    def _streamed(self) -> tuple[LineStream, datasets.Dataset]:
        """The training file as a stream; evaluation: the validation file, else its first documents."""
        import datasets

        cfg, root = self.cfg, cache_root(self.cfg.cache_dir, self.cfg.name)
        assert cfg.data_files.train is not None  # the schema's check for streaming
        path = Path(cfg.data_files.train).expanduser()
        reader = LineReader(path, cfg.text_field if path.suffix.lower() == ".jsonl" else None)
        if cfg.data_files.validation is not None:
            evaluation, begin = load_documents(cfg, root / "raw", ("validation",))["validation"], 0
        else:
            held, begin = first_documents(path, reader, cfg.eval_documents)
            if len(held) < cfg.eval_documents or begin >= path.stat().st_size:
                raise ConfigError(f"{path} has {len(held)} document(s), too few to hold out task.eval_documents="
                                  f"{cfg.eval_documents} for evaluation and stream the rest; give "
                                  "task.data_files.validation or a smaller task.eval_documents.")
            rows = datasets.Dataset.from_dict({cfg.text_field: held})
            evaluation = Split(rows, digest(*held), f"{path} (its first {len(held)} documents)")
        if not first_documents(path, reader, 1)[0]:  # the format of the first line is checked before training, too
            raise ConfigError(f"{path} holds no document.")
        stream = LineStream(path, begin, reader, functools.partial(encode_documents, self.tokenizer),
                            cfg.block_size, cfg.packing)
        evaluation_rows = tokenize_split(evaluation, "validation", self.tokenizer, cfg, root, cfg.name)
        after = " after the evaluation documents" if begin else ""
        streamed = f"train: streamed from {path} ({path.stat().st_size - begin:,} bytes{after}), read while training"
        self._splits_read = [streamed, self._split_read("evaluation", evaluation, evaluation_rows)]
        return stream, evaluation_rows

    # -- model and steps -----------------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        model = load_model(self.cfg, self.tokenizer)
        self._flops_per_token = flops_per_token(model, self.cfg.block_size)
        return model

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Per row, the summed loss of its predicted tokens and their number: the engine averages over
        the tokens of the whole optimizer step, so a short row's tokens weigh what a long row's do."""
        losses, tokens = row_token_losses(model, batch)
        return StepOutput(sample_losses=losses, sample_items=tokens)

    def evaluation_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per sample: the summed loss of its predicted tokens (each token predicts the next) and their count."""
        losses, tokens = row_token_losses(model, batch)
        return {"loss_sum": losses, "tokens": tokens}

    def metrics_from_sums(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["tokens"], 1)
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf}

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Not called (the engine reduces :meth:`evaluation_sums` instead); from gathered per-sample
        rows of (loss sum, token count) it gives the same metrics."""
        totals = logits.double().sum(dim=0).tolist()
        return self.metrics_from_sums({"loss_sum": totals[0], "tokens": totals[1]})

    def tokens_in_batch(self, batch: Any) -> torch.Tensor:
        """The batch's trained tokens (labels other than -100), a 0-d tensor on the batch's device."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the built model at ``task.block_size`` (see ``models.flops_per_token``)."""
        if self._flops_per_token is None:
            raise RuntimeError("build_model() measures the model; call it before flops_per_token().")
        return self._flops_per_token

    # -- export --------------------------------------------------------------------------------------------

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """The tokenizer, config.json and generation_config.json: the folder loads with
        ``AutoModelForCausalLM.from_pretrained`` and generates with its tokens (EOS...)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(folder)
        config: Any = model.config
        config.architectures = [type(model).__name__]
        config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(folder)


def row_token_losses(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next-token losses summed over its predicted tokens (labels -100 are not predicted),
    and how many tokens that is."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
    losses, targets = token_losses(logits, batch["labels"])
    return losses.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next-token loss at each position (0 where the next label is -100) and the targets (labels
    shifted left). The labels are shifted, not the logits (as transformers' own loss does): the
    vocabulary-sized logits are read in place, never copied for a shift."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none").view_as(targets)
    return losses, targets
