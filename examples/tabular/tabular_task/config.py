"""The task's schema: a dataclass subclassing the app's TaskConfig (its ``name`` and ``check()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.config import ConfigError, TaskConfig


@dataclass
class TabularConfig(TaskConfig):
    name: str = "tabular"
    samples: int = 2000
    """Rows generated: one Gaussian cluster of points per class."""
    features: int = 16
    classes: int = 4
    class_separation: float = 2.5
    """Distance of the class centres from the origin, in standard deviations: smaller is harder."""
    data_seed: int = 0
    """Seeds the data and the train/evaluation split (the run's ``seed`` seeds the training)."""
    eval_fraction: float = 0.2
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    dropout: float = 0.1

    def check(self) -> None:
        """The task's own rules: one sentence each (ConfigError), before anything runs."""
        if self.classes < 2:
            raise ConfigError(f"task.classes must be 2 or more, got {self.classes}.")
        if self.samples < 2 * self.classes:
            raise ConfigError(f"task.samples={self.samples} is too few for {self.classes} classes.")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"task.eval_fraction must be in (0, 1), got {self.eval_fraction}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"task.dropout must be in [0, 1), got {self.dropout}.")
