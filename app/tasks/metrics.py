"""Classification metrics computed on gathered logits and labels."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, f1_average: str) -> dict[str, float]:
    """Loss, accuracy and F1. ``f1_average`` is ``macro`` (mean over classes) or ``binary`` (class 1)."""
    logits = logits.float()
    preds = logits.argmax(dim=-1)
    num_classes = logits.shape[-1]
    f1_per_class = []
    for c in range(num_classes):
        tp = ((preds == c) & (labels == c)).sum().item()
        fp = ((preds == c) & (labels != c)).sum().item()
        fn = ((preds != c) & (labels == c)).sum().item()
        f1_per_class.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    if f1_average == "binary":
        f1 = f1_per_class[1]
    elif f1_average == "macro":
        f1 = sum(f1_per_class) / num_classes
    else:
        raise ValueError(f"unknown f1_average {f1_average!r}")
    return {
        "loss": F.cross_entropy(logits, labels).item(),
        "accuracy": (preds == labels).float().mean().item(),
        "f1": f1,
    }
