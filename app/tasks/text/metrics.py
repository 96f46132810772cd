"""The three problems of text classification and their metrics by name (``task.metrics``), computed by
scikit-learn and SciPy on the gathered outputs.

Light at import (the libraries are imported when metrics are computed, in the worker): config checks
read the names. Every evaluation also reports ``loss``, the training objective of the problem
(cross-entropy, mean squared error, binary cross-entropy) on the whole evaluation set.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class Problem(str, enum.Enum):
    single_label = "single_label"
    """One class per text: softmax and cross-entropy."""
    regression = "regression"
    """One number per text: one output, mean squared error."""
    multi_label = "multi_label"
    """Any number of classes per text (a list column): one sigmoid per class, binary cross-entropy."""


class F1Average(str, enum.Enum):
    """scikit-learn's ``average`` of f1/precision/recall over classes (single_label problems)."""

    binary = "binary"
    macro = "macro"
    micro = "micro"
    weighted = "weighted"


Metric = Callable[[Any, Any, dict[str, Any]], float]
"""(targets, predictions, averaging) -> value. Predictions: class ids (single_label), values
(regression), 0/1 indicator rows (multi_label). Averaging: how metrics over classes average
(``average``, ``task.f1_average``) and over which classes (``labels``: all of the label set, also
those absent from an evaluation set)."""


def _sklearn(name: str, averaged: bool = False, **fixed: Any) -> Metric:
    """``sklearn.metrics.<name>``; ``averaged``: over classes as ``task.f1_average`` says."""
    def metric(y: np.ndarray, pred: np.ndarray, averaging: dict[str, Any]) -> float:
        import sklearn.metrics

        return float(getattr(sklearn.metrics, name)(y, pred, **fixed, **(averaging if averaged else {})))

    return metric


def _scipy(name: str) -> Metric:
    def metric(y: np.ndarray, pred: np.ndarray, averaging: dict[str, Any]) -> float:
        import numpy as np
        import scipy.stats

        if np.all(pred == pred[0]) or np.all(y == y[0]):
            return float("nan")  # a constant has no correlation (SciPy would warn and say the same)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(getattr(scipy.stats, name)(y, pred)[0])

    return metric


METRICS: dict[Problem, dict[str, Metric]] = {
    Problem.single_label: {
        "accuracy": _sklearn("accuracy_score"),
        "f1": _sklearn("f1_score", averaged=True, zero_division=0.0),
        "precision": _sklearn("precision_score", averaged=True, zero_division=0.0),
        "recall": _sklearn("recall_score", averaged=True, zero_division=0.0),
        "matthews_corrcoef": _sklearn("matthews_corrcoef"),
        "balanced_accuracy": _sklearn("balanced_accuracy_score"),
    },
    Problem.regression: {
        "pearson": _scipy("pearsonr"),
        "spearman": _scipy("spearmanr"),
        "mse": _sklearn("mean_squared_error"),
        "mae": _sklearn("mean_absolute_error"),
        "r2": _sklearn("r2_score"),
    },
    Problem.multi_label: {
        "f1_micro": _sklearn("f1_score", average="micro", zero_division=0.0),
        "f1_macro": _sklearn("f1_score", average="macro", zero_division=0.0),
        "f1_samples": _sklearn("f1_score", average="samples", zero_division=0.0),
        "exact_match": _sklearn("accuracy_score"),
        "hamming_loss": _sklearn("hamming_loss"),
    },
}
"""Every metric ``task.metrics`` may name, by problem."""

DEFAULT_METRICS: dict[Problem, tuple[str, ...]] = {
    Problem.single_label: ("accuracy", "f1"),
    Problem.regression: ("pearson", "spearman"),
    Problem.multi_label: ("f1_micro", "f1_macro"),
}
"""``task.metrics=null``."""


def chosen_metrics(problem: Problem, metrics: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(metrics) if metrics is not None else DEFAULT_METRICS[problem]


def f1_average(choice: F1Average | None, num_classes: int) -> str:
    """``task.f1_average``; null: binary (F1 of class 1) for two classes, the mean over classes otherwise."""
    if choice is not None:
        return choice.value
    return "binary" if num_classes == 2 else "macro"


def compute(problem: Problem, names: Sequence[str], logits: Any, labels: Any, average: str) -> dict[str, float]:
    """``loss`` and the named metrics of gathered outputs (torch tensors) against their targets."""
    import numpy as np
    from torch.nn import functional as F

    logits = logits.float()
    if problem is Problem.single_label:
        loss = F.cross_entropy(logits, labels)
        y, pred = labels.numpy(), logits.argmax(dim=-1).numpy()
    elif problem is Problem.regression:
        values = logits.squeeze(-1)
        loss = F.mse_loss(values, labels.float())
        y, pred = labels.float().numpy(), values.numpy()
    else:
        loss = F.binary_cross_entropy_with_logits(logits, labels.float())
        y, pred = labels.numpy().astype(np.int64), (logits > 0).numpy().astype(np.int64)  # sigmoid > 0.5
    # Binary F1 is class 1's alone; the other averages run over every class of the label set.
    averaging = {"average": average, **({} if average == "binary" else {"labels": list(range(logits.shape[-1]))})}
    metrics = {"loss": loss.item()}
    for name in names:
        metrics[name] = METRICS[problem][name](y, pred, averaging)
    return metrics
