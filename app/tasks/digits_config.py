"""Schema of the digits task, kept apart from the task so composing a config does not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.config import TaskConfig


@dataclass
class DigitsConfig(TaskConfig):
    name: str = "digits"
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.1
    eval_fraction: float = 0.2
    """Share of the 1,797 images held out for validation (stratified, fixed by split_seed)."""
    split_seed: int = 0
