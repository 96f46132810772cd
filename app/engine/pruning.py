"""What the loop asks of a sweep's pruner after each evaluation (``Components.pruning``).

A pruned sweep (``app.sweeps.trial_pruning``) reports every evaluation of its trial to the study and
answers, when the study says the trial is clearly worse than the others were at the same point, with
the sentence to stop on; the loop then stops as on an early stop (every process, at the same step).
Outside such a sweep the run has :class:`NoPruning`, which answers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PrunedAt:
    """Where a trial was pruned: its ``evaluation``-th scheduled evaluation, at optimizer ``step``."""

    evaluation: int
    step: int


class Pruning(Protocol):
    pruned_at: PrunedAt | None
    """Set once the trial is pruned (also by an earlier segment of a resumed run): the run ends as
    ``pruned``, not ``finished``."""

    def after_evaluation(self, step: int, epoch: int, metrics: dict[str, float], stopping: bool) -> str | None:
        """Report this evaluation; the stop sentence when the trial is pruned now, else None.
        ``stopping``: the run stops here anyway (early stopping, a NaN loss), so it is reported, never pruned."""
        ...


class NoPruning:
    """The default: not a trial of a pruned sweep (or not the main process, which alone talks to the study)."""

    pruned_at: PrunedAt | None = None

    def after_evaluation(self, step: int, epoch: int, metrics: dict[str, float], stopping: bool) -> str | None:
        return None
