"""Schema of ``task=causal_lm``. Kept free of torch, transformers and datasets: config composition imports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from app.config import ConfigError, TaskConfig
from app.tasks.model_folders import refuse_run_folder

STREAMED_SUFFIXES = (".txt", ".text", ".jsonl")
"""What ``task.streaming=true`` reads line by line (and can seek in by byte offset)."""


ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""``task.attn_implementation``'s values: Transformers' attention implementations."""


@dataclass
class LMDataFiles:
    """Local files, one per split: plain text (``.txt``, one document per line), JSON Lines (``.jsonl``,
    the text in ``task.text_field``), JSON, CSV, parquet, arrow, or a ``save_to_disk`` folder."""

    train: str | None = None
    validation: str | None = None
    """null: ``task.eval_fraction`` of train's documents are held out (``task.eval_documents`` when streaming)."""


@dataclass
class CausalLMConfig(TaskConfig):
    """A Transformers causal language model (``AutoModelForCausalLM``) trained on text."""

    DATA_NEEDED: ClassVar[str] = "text"
    DATA_FILES: ClassVar[str] = "plain text, one document per line; JSON Lines; parquet..."

    name: str = "causal_lm"
    # -- data: data_files.train, else dataset ----------------------------------------------------------
    data_files: LMDataFiles = field(default_factory=LMDataFiles)
    dataset: str | None = None
    """``datasets.load_dataset(task.dataset, task.dataset_config)``: a hub name or a local folder."""
    dataset_config: str | None = None
    text_field: str = "text"
    """The column (JSON Lines key) holding each document's text; a plain text file's is ``text``."""
    eval_fraction: float = 0.1
    """Share of train's documents held out for evaluation when there is no validation split."""
    split_seed: int = 0
    eval_documents: int = 200
    """Streaming without a validation file: the first N documents of the training file are the
    evaluation set (and the stream starts after them)."""
    # -- model -----------------------------------------------------------------------------------------
    model: str | None = None
    """Pretrained weights: a local folder or a hub name (``AutoModelForCausalLM.from_pretrained``)."""
    config: str | None = None
    """A randomly initialised model instead: a folder (or hub name) with ``config.json``, or a model type
    (``llama``, ``gpt2``...) with its defaults; ``task.config_overrides`` changes its values."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Values over the model's configuration, e.g. ``{hidden_size: 64, num_hidden_layers: 2}``."""
    tokenizer: str | None = None
    """null: the tokenizer saved in ``task.model`` (or ``task.config``)."""
    attn_implementation: str | None = None
    """null: Transformers' choice (SDPA where the model has it); or one of ``ATTENTION``, e.g.
    ``flash_attention_2`` (the flash-attn package on a CUDA GPU: packed rows then run its varlen kernel)."""
    block_size: int = 512
    """Tokens per training sample: a packed block, or the most of one document kept (``packing=false``)."""
    packing: bool = True
    """Concatenate the documents (EOS between them) and cut blocks of ``block_size`` tokens: fixed shapes,
    no padding. false: one document per row (truncated to block_size), padded per batch, the loss
    masked on the padding."""
    streaming: bool = False
    """Read the training file line by line while training (a ``.txt`` or ``.jsonl`` file, never loaded
    whole), each process its own part, packed on the fly; an exact resume restarts at the saved byte
    offsets. Needs ``trainer.max_steps`` (a stream's length is unknown until it ends)."""
    cache_dir: str | None = None
    """Where tokenized splits are cached; null uses <HF_DATASETS_CACHE>/app_text_<task name>."""

    @property
    def streams_training_data(self) -> bool:
        return self.streaming

    def check(self) -> None:
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTION:
            raise ConfigError(f"task.attn_implementation={self.attn_implementation} is none of "
                              f"{', '.join(ATTENTION)} (or null: Transformers' choice).")
        if self.block_size < 2:
            raise ConfigError(f"task.block_size must be at least 2 tokens, got {self.block_size}.")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction must be in (0, 1), got {self.eval_fraction}.")
        if self.eval_documents < 1:
            raise ConfigError(f"task.eval_documents must be at least 1, got {self.eval_documents}.")
        if (self.model is None) == (self.config is None):
            raise ConfigError(f"task={self.name} needs one model: task.model=<folder or hub name> (pretrained weights) "
                              "or task.config=<config folder or model type> (randomly initialised), not both."
                              if self.model is not None else
                              f"task={self.name} needs a model: task.model=<folder or hub name> (pretrained weights) or "
                              "task.config=<config folder or model type> (randomly initialised).")
        for key, value in (("task.model", self.model), ("task.config", self.config), ("task.tokenizer", self.tokenizer)):
            refuse_run_folder(key, value)
        if self.data_files.train is None and self.data_files.validation is not None:
            raise ConfigError("task.data_files.validation needs task.data_files.train too.")
        if self.data_files.train is None and self.dataset is None:
            raise ConfigError(f"task={self.name} needs {self.DATA_NEEDED}: task.data_files.train=<file> "
                              f"({self.DATA_FILES}) or task.dataset=<hub name or folder>.")
        if self.streaming:
            train = self.data_files.train
            if train is None or Path(train).suffix.lower() not in STREAMED_SUFFIXES:
                raise ConfigError("task.streaming=true reads a local plain text or JSON Lines file line by line: give "
                                  "task.data_files.train=<.txt or .jsonl file>.")
