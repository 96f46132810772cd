"""Optimizer and scheduler wrappers that act only on synchronising micro-steps.

Inside ``accumulate``, user code calls ``optimizer.step()``, ``scheduler.step()`` and
``optimizer.zero_grad()`` on every micro-batch; these wrappers make the calls count only when the
gradients are complete. A step skipped by fp16 loss scaling is reported through ``step_was_skipped``
and the scheduler does not advance on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from app.distributed.precision import Precision
from app.distributed.state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    # Subclassing Optimizer (without its __init__) keeps isinstance checks of LR schedulers working.
    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState, precision: Precision,
                 step_end: Callable[[], None] | None = None):
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.precision = precision
        self.step_end = step_end
        """The backend's end-of-step hook (``Backend.step_end``), run after every real step."""
        self.step_was_skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if self.gradient_state.sync_gradients:
            self.step_was_skipped = not self.precision.optimizer_step(self.optimizer, closure)
            if self.step_end is not None:
                self.step_end()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def train(self) -> None:
        """Schedule-free optimizers switch their parameters to training mode (no-op for others)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Schedule-free optimizers switch their parameters to the averaged (evaluation) point."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class AcceleratedScheduler:
    """Steps the wrapped scheduler ``steps_per_optimizer_step`` times per real optimizer step
    (Accelerate: once per process unless ``split_batches``; our engine: once)."""

    def __init__(self, scheduler: Any, optimizers: list[AcceleratedOptimizer], gradient_state: GradientState,
                 step_with_optimizer: bool = True, steps_per_optimizer_step: int = 1):
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_optimizer_step = steps_per_optimizer_step
        self._bounded = hasattr(scheduler, "total_steps")
        """OneCycleLR-like: it raises when stepped past ``total_steps``, so the last steps are skipped."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        scheduler = self.scheduler
        if not self.step_with_optimizer:
            scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        for opt in self.optimizers:
            if opt.step_was_skipped:
                return
        if self.steps_per_optimizer_step == 1 and not self._bounded:  # every step of most runs
            scheduler.step(*args, **kwargs)
            return
        for _ in range(self.steps_per_optimizer_step):
            if not self._bounded or scheduler._step_count <= scheduler.total_steps:
                scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)
