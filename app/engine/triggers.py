"""Stop conditions. Each process evaluates them locally and raises the runtime's trigger; the loop
acts on ``check_trigger`` so every process stops on the same step."""

from __future__ import annotations

import math
from typing import Any


class EarlyStopping:
    """Patience on a monitored metric: stop after ``patience`` evaluations without an improvement of
    more than ``min_delta`` over the best value so far."""

    def __init__(self, monitor: str, mode: str, patience: int | None, min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        """The optimizer step of the evaluation that set ``best``."""
        self.best_metrics: dict[str, float] = {}
        """That evaluation's metrics (what ``checkpoint.export=best`` exports was measured so)."""
        self.bad_evaluations = 0

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def update(self, metrics: dict[str, float], step: int | None = None) -> bool:
        """Record one evaluation (at optimizer step ``step``); returns True when training should stop."""
        if self.monitor not in metrics:
            raise KeyError(
                f"early_stopping.monitor={self.monitor!r} is not among the evaluation metrics "
                f"{sorted(metrics)}."
            )
        value = float(metrics[self.monitor])
        if not math.isfinite(value):
            self.bad_evaluations += 1
        elif self.improved(value):
            self.best, self.best_step, self.best_metrics = value, step, dict(metrics)
            self.bad_evaluations = 0
        else:
            self.bad_evaluations += 1
        return self.patience is not None and self.bad_evaluations >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "best_metrics": self.best_metrics,
                "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        # Checkpoints written before these were recorded have neither.
        self.best_step = state.get("best_step")
        self.best_metrics = dict(state.get("best_metrics") or {})
        self.bad_evaluations = int(state["bad_evaluations"])
