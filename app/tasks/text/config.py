"""Schema of ``task=text_classification`` (and of the GLUE presets, which are this task with values).

Kept free of torch, transformers and datasets: config composition imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.config import ConfigError, TaskConfig
from app.tasks.model_folders import refuse_run_folder
from app.tasks.text.glue import GLUE_SPECS, GlueName
from app.tasks.text.metrics import METRICS, F1Average, Problem


class Pooling(str, enum.Enum):
    cls = "cls"
    """The model's own sequence-classification head (BERT: the [CLS] state through its pooler)."""
    mean = "mean"
    """A linear classifier on the mean of the token states: the head for sentence-transformers
    checkpoints, which were trained with mean pooling (app/tasks/text/mean_pooling.py)."""


@dataclass
class DataFiles:
    """Local files, one per split: CSV, TSV, JSON, JSON Lines, parquet, arrow, or a ``save_to_disk`` folder."""

    train: str | None = None
    validation: str | None = None
    """null: ``task.eval_fraction`` of train is held out (seeded by ``task.split_seed``; stratified
    for single_label problems)."""
    test: str | None = None
    """Optional: what ``task.predict_test=true`` predicts (its labels, if any, are not used)."""


@dataclass
class TextClassificationConfig(TaskConfig):
    """A Transformers encoder fine-tuned on one or two text columns to a class, several classes or a number."""

    name: str = "text_classification"
    # -- data: the first of data_files.train, data_dir, dataset that is given ----------------------------
    data_files: DataFiles = field(default_factory=DataFiles)
    data_dir: str | None = None
    """A folder in GLUE's layouts (its TSVs, the hub's parquet/arrow files, a save_to_disk folder), for
    the GLUE presets (``task.glue``)."""
    dataset: str | None = None
    """``datasets.load_dataset(task.dataset, task.dataset_config)``: a hub name or a local folder."""
    dataset_config: str | None = None
    glue: GlueName | None = None
    """The GLUE task this preset is (app/tasks/text/glue.py): its TSV layout, fixed label names and
    evaluation splits; null for your own data."""
    text_fields: list[str] = field(default_factory=lambda: ["text"])
    """One column (single texts) or two (pairs, encoded together)."""
    label_field: str = "label"
    problem: Problem | None = None
    """null: from the label column (floats: regression, lists: multi_label, else single_label)."""
    metrics: list[str] | None = None
    """By name (app/tasks/text/metrics.py); null: accuracy, f1 | pearson, spearman | f1_micro, f1_macro."""
    f1_average: F1Average | None = None
    """f1, precision, recall of single_label problems; null: binary for two classes, macro otherwise."""
    eval_fraction: float = 0.1
    """Share of train held out for evaluation when there is no validation split."""
    split_seed: int = 0
    # -- model -------------------------------------------------------------------------------------------
    model: str = "bert-base-cased"
    """Hub name or local folder, loaded with AutoModelForSequenceClassification.from_pretrained."""
    tokenizer: str | None = None
    """Defaults to ``model``."""
    pooling: Pooling = Pooling.cls
    """cls exports a plain transformers model; mean exports one that loads with trust_remote_code=True."""
    max_length: int = 128
    pad_to_max_length: bool = False
    """Pad every batch to max_length (fixed shapes, for XLA) instead of to the longest in the batch."""
    label_smoothing: float = 0.0
    """single_label, training loss only: cross-entropy against (1 - eps) one-hot + eps uniform."""
    # -- pairs -------------------------------------------------------------------------------------------
    swap_pairs: bool = False
    """Also train on every pair in the other order (for symmetric relations: a paraphrase is one both
    ways): the train split doubles, and so does the cost of an epoch; evaluation is unchanged."""
    symmetric_eval: bool = False
    """Evaluate (and predict the test split) on each pair in both orders and average the two
    log-probabilities (regression, multi_label: the two outputs). Costs a second forward pass per
    evaluated pair; training and the exported model (it scores one order) are unchanged."""
    # -- outputs -----------------------------------------------------------------------------------------
    predict_test: bool = False
    """Write test-split predictions to <run folder>/test_predictions.tsv at the end."""
    cache_dir: str | None = None
    """Where tokenized splits are cached; null uses <HF_DATASETS_CACHE>/app_text_<task name>."""

    def check(self) -> None:
        refuse_run_folder("task.model", self.model)
        refuse_run_folder("task.tokenizer", self.tokenizer)
        if self.max_length < 8:
            raise ConfigError(f"task.max_length must be at least 8, got {self.max_length}.")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"task.label_smoothing must be in [0, 1), got {self.label_smoothing}.")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction must be in (0, 1), got {self.eval_fraction}.")
        if len(self.text_fields) not in (1, 2) or len(set(self.text_fields)) != len(self.text_fields):
            raise ConfigError(f"task.text_fields must name one text column or two different ones (a pair), got "
                              f"{list(self.text_fields)}.")
        if self.label_field in self.text_fields:
            raise ConfigError(f"task.label_field={self.label_field} is also one of task.text_fields.")
        if (self.swap_pairs or self.symmetric_eval) and len(self.text_fields) != 2:
            raise ConfigError("task.swap_pairs and task.symmetric_eval need pairs: two task.text_fields.")
        if self.data_files.train is None and (self.data_files.validation or self.data_files.test):
            raise ConfigError("task.data_files.validation and .test need task.data_files.train too.")
        if self.data_files.train is None and self.data_dir is None and self.dataset is None:
            raise ConfigError(f"task={self.name} needs data: task.data_files.train=<file> (CSV, TSV, JSON, JSON Lines, "
                              "parquet, or a save_to_disk folder), or task.dataset=<hub name or folder>.")
        if self.glue is None and self.data_dir is not None and self.data_files.train is None:
            raise ConfigError("task.data_dir reads GLUE's file layouts, for the GLUE presets (task=glue_<name>); give "
                              "your own files as task.data_files.train=<file> (and .validation, .test).")
        if self.problem is not None and self.problem is not Problem.single_label and self.label_smoothing:
            raise ConfigError("task.label_smoothing applies to single_label problems only.")
        problems = [self.problem] if self.problem is not None else list(Problem)
        for name in self.metrics or []:
            if not any(name in METRICS[p] for p in problems):
                known = ", ".join(sorted({m for p in problems for m in METRICS[p]}))
                what = f"{self.problem.value} problems" if self.problem is not None else "any problem"
                raise ConfigError(f"task.metrics has {name!r}, which is not a metric of {what}; choose from {known}.")
        if self.glue is not None:
            spec = GLUE_SPECS[self.glue]
            if list(self.text_fields) != list(spec.text_columns):
                raise ConfigError(f"task.glue={self.glue.value} reads the text columns {', '.join(spec.text_columns)}; "
                                  "leave task.text_fields as the preset sets it.")
