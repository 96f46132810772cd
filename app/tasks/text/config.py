"""The GLUE tasks' shared schema fields and the spec that tells one task's data apart.

Kept free of torch, transformers and datasets: config composition imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from app.config import ConfigError, TaskConfig


class Pooling(str, Enum):
    cls = "cls"
    """The model's own sequence-classification head (BERT: the [CLS] state through its pooler)."""
    mean = "mean"
    """A linear classifier on the mean of the token states: the head for sentence-transformers
    checkpoints, which were trained with mean pooling (app/tasks/mean_pooling.py)."""


@dataclass(frozen=True)
class GlueSpec:
    """What one GLUE task's data looks like: all the shared loaders, parser, cache and model need."""

    config: str
    """The hub dataset's config name (``mrpc``); also the default cache folder ``app_glue_<config>``."""
    title: str
    """The task's name in messages and progress bars (``MRPC``)."""
    text_columns: tuple[str, ...]
    """The hub's text columns, in the order the tokenizer takes them: one sentence or a pair."""
    label_names: tuple[str, ...]
    """Names of labels 0, 1, ...: written into the exported model's config."""
    tsv_text_headers: tuple[str, ...] | None = None
    """The text columns' names in a GLUE TSV header, when they differ from ``text_columns``."""
    tsv_label_header: str = "label"
    """The label column's name in a GLUE TSV header (the test file has ``index`` instead)."""
    folders: tuple[str, ...] = ()
    """Subfolders of ``task.data_dir`` also searched for the files (after the folder itself)."""

    @property
    def name(self) -> str:
        """The task's name (``task=glue_<config>``)."""
        return f"glue_{self.config}"

    @property
    def text_headers(self) -> tuple[str, ...]:
        return self.tsv_text_headers or self.text_columns

    @property
    def items(self) -> str:
        """What one row holds, in messages: ``sentence pairs`` or ``sentences``."""
        return "sentence pairs" if len(self.text_columns) == 2 else "sentences"

    @property
    def items_short(self) -> str:
        return "pairs" if len(self.text_columns) == 2 else "sentences"


@dataclass
class GlueConfig(TaskConfig):
    """Fields every GLUE task has; a task's schema subclasses it and sets ``spec``."""

    spec: ClassVar[GlueSpec]
    """The task's data description (a class attribute, not a config key)."""
    model: str = "bert-base-cased"
    """Hub name or local folder, loaded with AutoModelForSequenceClassification.from_pretrained."""
    pooling: Pooling = Pooling.cls
    """cls exports a plain transformers model; mean exports one that loads with trust_remote_code=True."""
    label_smoothing: float = 0.0
    """Training loss only: cross-entropy against (1 - eps) one-hot + eps uniform; eval/loss stays plain."""
    tokenizer: str | None = None
    """Defaults to ``model``."""
    data_dir: str | None = None
    """Local folder with GLUE TSV (train/validation|dev/test .tsv) or parquet/arrow files; null uses the hub."""
    hub_dataset: str = "nyu-mll/glue"
    max_length: int = 128
    pad_to_max_length: bool = False
    """Pad every batch to max_length (fixed shapes, for XLA) instead of to the longest in the batch."""
    predict_test: bool = False
    """Write test-split predictions to <run folder>/test_predictions.tsv at the end."""
    cache_dir: str | None = None
    """Where tokenized splits are cached; null uses <HF_DATASETS_CACHE>/app_glue_<spec.config>."""

    def check(self) -> None:
        if self.max_length < 8:
            raise ConfigError(f"task.max_length must be at least 8, got {self.max_length}.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"task.label_smoothing must be in [0, 1), got {self.label_smoothing}.")
