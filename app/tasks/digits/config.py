"""Schema of the digits task, kept apart from the task so composing a config does not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.config import ConfigError, TaskConfig


@dataclass
class DigitsConfig(TaskConfig):
    name: str = "digits"
    hidden_sizes: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.1
    eval_fraction: float = 0.2
    """Share of the 1,797 images held out for validation (stratified, fixed by split_seed)."""
    split_seed: int = 0

    def check(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction must be in (0, 1), got {self.eval_fraction}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}.")
        if any(size <= 0 for size in self.hidden_sizes):
            raise ConfigError(f"task.hidden_sizes must all be positive, got {list(self.hidden_sizes)}.")
