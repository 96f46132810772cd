"""Stop conditions. Each process evaluates them locally and raises the runtime's trigger; the loop
acts on ``check_trigger`` so every process stops on the same step."""

from __future__ import annotations

import math
from typing import Any


class EarlyStopping:
    """Patience on a monitored metric, and the one rule for which evaluation is the best.

    The best evaluation is the first to reach the best value: one strictly better than every
    evaluation before it (a later tie is not a new best, as in Lightning and the Hugging Face
    Trainer). The export (``checkpoint.export=best``), ``keep_best``, the log, ``result.json`` and a
    sweep's report all name that one.

    Training stops after ``patience`` evaluations in a row without an improvement of more than
    ``min_delta`` over the value of the last evaluation that made one (Lightning's rule): a tie, or a
    gain of ``min_delta`` or less, counts as no improvement (the latter still becomes the best)."""

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
        self.reference: float | None = None
        """The value of the last evaluation that improved by more than min_delta (``best`` when it is 0)."""
        self.bad_evaluations = 0

    def _better(self, value: float, than: float, margin: float = 0.0) -> bool:
        return value > than + margin if self.mode == "max" else value < than - margin

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
        else:
            if self.best is None or self._better(value, self.best):
                self.best, self.best_step, self.best_metrics = value, step, dict(metrics)
            if self.reference is None or self._better(value, self.reference, self.min_delta):
                self.reference = value
                self.bad_evaluations = 0
            else:
                self.bad_evaluations += 1
        return self.patience is not None and self.bad_evaluations >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "best_metrics": self.best_metrics,
                "reference": self.reference, "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        # Checkpoints written before these were recorded have only best and bad_evaluations.
        self.best_step = state.get("best_step")
        self.best_metrics = dict(state.get("best_metrics") or {})
        self.reference = state.get("reference", self.best)
        self.bad_evaluations = int(state["bad_evaluations"])
