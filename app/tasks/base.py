"""The task interface: what the engine needs from a task, and nothing more.

A task builds its datasets (with a collate function), builds its model, runs one forward pass on a
batch, and turns gathered logits and labels into metrics. The engine owns everything else (devices,
processes, precision, the loop), so a new task is one small module.

What a task may ask of the runtime while it builds its data is :class:`TaskRuntime` (the
Accelerator satisfies it). Optional abilities are their own protocols, which the engine checks for where it uses them:
:class:`PredictsTest` (predictions on an unlabeled test split). Sample lengths for
``trainer.group_by_length`` are :attr:`TaskData.train_lengths` (None: the task gives none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass
class TaskData:
    train: Dataset
    eval: Dataset
    collate_fn: Callable[[list[Any]], Any] | None = None
    train_lengths: Sequence[int] | None = None
    """Length of each training sample (e.g. tokens), for ``trainer.group_by_length``; None if the
    samples all cost the same."""


@dataclass
class StepOutput:
    loss: torch.Tensor
    """Mean loss over the batch (a 0-d tensor)."""
    logits: torch.Tensor
    """One row per sample."""
    labels: torch.Tensor
    """One entry per sample."""


class TaskRuntime(Protocol):
    """The runtime as a task sees it while building its data (the Accelerator is one)."""

    @property
    def is_main_process(self) -> bool:
        """True on the one process that shows progress and fills shared caches first."""
        ...

    @property
    def static_shapes(self) -> bool:
        """True when every step must see the same tensor shapes (XLA): pad to a fixed length."""
        ...

    def main_process_first(self) -> AbstractContextManager[None]:
        """The main process runs the block first (filling caches), then the others."""
        ...


class Task(Protocol):
    name: str
    metric_names: tuple[str, ...]
    """The keys compute_metrics returns (the engine logs them as ``eval/<name>``): checked against
    ``early_stopping.monitor`` before anything runs."""

    def build_data(self, runtime: TaskRuntime) -> TaskData:
        """Load and preprocess the datasets (``runtime``: the Accelerator, see :class:`TaskRuntime`)."""
        ...

    def build_model(self) -> nn.Module: ...

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """One forward pass on a batch already on the right device."""
        ...

    def compute_metrics(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics over the whole, gathered and de-duplicated evaluation set (keys without prefix)."""
        ...

    def save_artifacts(self, model: nn.Module, folder: Path) -> None:
        """Write whatever besides weights makes the exported model usable (tokenizer, config...)."""
        ...


@runtime_checkable
class PredictsTest(Protocol):
    """A task that predicts its unlabeled test split (``task.predict_test=true``; its schema then has
    the field: :class:`app.config.PredictsTestConfig`). Used by ``app/engine/predict.py``."""

    def test_dataset(self) -> Any:
        """The test split, in file order, as the evaluation loader's collate function takes it."""
        ...

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Logits for a batch already on the right device."""
        ...

    def write_predictions(self, preds: Iterable[int], path: str | Path) -> None:
        """Write one predicted class per test row, in file order (the main process only calls it)."""
        ...
