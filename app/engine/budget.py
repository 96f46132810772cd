"""How long a run trains: ``trainer.max_steps`` and ``trainer.max_epochs`` as optimizer steps, which of
the two ends the run, and the sentences that say so at the start and when training stops.

Which limits a run has is decided when its config is composed (``app.cli.configure.limits_as_given``: a
``trainer.max_steps`` given alone on the command line is not cut short by a task's preset epochs);
here both limits, when both are set, are weighed against the length of an epoch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from app.config import TrainerConfig


class Limit(enum.Enum):
    """A limit on a run's length, by the key that sets it."""

    max_steps = "trainer.max_steps"
    max_epochs = "trainer.max_epochs"


def steps_per_epoch(num_batches: int, accumulation: int) -> int:
    """Optimizer steps in one epoch: the last, shorter accumulation window also steps."""
    return math.ceil(num_batches / accumulation)


def epochs(count: int) -> str:
    return f"{count} epoch" + ("" if count == 1 else "s")


@dataclass(frozen=True)
class Budget:
    """The run's length in optimizer steps and the limit that sets it."""

    total_steps: int
    """What the learning-rate schedule is sized for and the progress bar counts to."""
    limit: Limit
    """The limit that ends the run: the one reached first (max_steps on a tie, and for a stream, whose
    epochs have no known length; its max_epochs, if set, may still end it first)."""
    max_steps: int
    max_epochs: int
    epoch_steps: int | None
    """Optimizer steps per epoch; None for a stream."""

    def reached(self, global_step: int, epoch: int) -> Limit | None:
        """The limit that has ended training after ``global_step`` optimizer steps and ``epoch`` whole
        epochs, if one has."""
        if global_step >= self.total_steps:
            return self.limit
        if 0 < self.max_epochs <= epoch:
            return Limit.max_epochs  # a stream's epochs, or fewer steps per epoch since a resume
        return None

    def start_sentence(self) -> str | None:
        """Which of two set limits will end the run (None when only one is set, or both end it at the
        same step)."""
        if self.max_steps <= 0 or self.max_epochs <= 0:
            return None
        steps, epoch_count = f"trainer.max_steps={self.max_steps}", f"trainer.max_epochs={self.max_epochs}"
        if self.epoch_steps is None:
            return (f"{steps} or {epoch_count}, whichever is reached first, ends training (a streamed epoch has "
                    "no known length).")
        by_epochs = self.epoch_steps * self.max_epochs
        if by_epochs == self.max_steps:
            return None
        if self.limit is Limit.max_steps:
            return (f"{steps} ends training, before {epoch_count} would ({by_epochs} optimizer steps, "
                    f"{self.epoch_steps} per epoch).")
        return (f"{epoch_count} ends training at optimizer step {by_epochs} ({self.epoch_steps} per epoch), "
                f"before {steps}.")


def training_budget(trainer: TrainerConfig, num_batches: int | None) -> Budget:
    """The budget of a run whose training loader has ``num_batches`` batches per epoch (None: a stream,
    whose length is unknown: trainer.max_steps then sizes the run, and the config requires it)."""
    epoch_steps = None if num_batches is None else steps_per_epoch(num_batches, trainer.gradient_accumulation_steps)
    by_epochs = epoch_steps * trainer.max_epochs if epoch_steps is not None and trainer.max_epochs > 0 else None
    by_steps = trainer.max_steps if trainer.max_steps > 0 else None
    if by_steps is not None and (by_epochs is None or by_steps <= by_epochs):
        total, limit = by_steps, Limit.max_steps
    else:
        assert by_epochs is not None  # the config refuses runs with neither limit
        total, limit = by_epochs, Limit.max_epochs
    return Budget(total, limit, trainer.max_steps, trainer.max_epochs, epoch_steps)
