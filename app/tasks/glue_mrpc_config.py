"""Schema of the GLUE MRPC task, kept apart from the task so composing a config stays light."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from app.config import ConfigError, TaskConfig


class Pooling(str, Enum):
    cls = "cls"
    """The model's own sequence-classification head (BERT: the [CLS] state through its pooler)."""
    mean = "mean"
    """A linear classifier on the mean of the token states: the head for sentence-transformers
    checkpoints, which were trained with mean pooling (app/tasks/mean_pooling.py)."""


@dataclass
class GlueMrpcConfig(TaskConfig):
    name: str = "glue_mrpc"
    model: str = "bert-base-cased"
    """Hub name or local folder, loaded with AutoModelForSequenceClassification.from_pretrained."""
    pooling: Pooling = Pooling.cls
    """cls exports a plain transformers model; mean exports one that loads with trust_remote_code=True."""
    label_smoothing: float = 0.0
    """Training loss only: cross-entropy against (1 - eps) one-hot + eps uniform; eval/loss stays plain."""
    swap_pairs: bool = False
    """Also train on every pair in the other order (a paraphrase is one both ways): the train split
    doubles, and so does the cost of an epoch; evaluation is unchanged."""
    symmetric_eval: bool = False
    """Evaluate (and predict the test split) on each pair in both orders and average the two
    log-probabilities: a paraphrase is one both ways, so the prediction should not depend on which
    sentence comes first. Costs a second forward pass per evaluated pair; training is unchanged, and
    so is the exported model (it scores one order: average both orders yourself to get these numbers)."""
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
    """Where tokenized splits are cached; null uses <HF_DATASETS_CACHE>/app_glue_mrpc."""

    def check(self) -> None:
        if self.max_length < 8:
            raise ConfigError(f"task.max_length must be at least 8, got {self.max_length}.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"task.label_smoothing must be in [0, 1), got {self.label_smoothing}.")
