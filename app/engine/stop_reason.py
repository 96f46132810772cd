"""Why training stopped: one enum member per kind of stop, each its sentence. The loop
(``app/engine/loop.py``) decides which; the sentence is what a user reads."""

from __future__ import annotations

import enum
from typing import Any

NON_FINITE_LOSS = "training loss is"
"""How a stop reason for a NaN/infinite loss begins (a run that ends so is no result for a sweep)."""


class StopReason(enum.Enum):
    """Why training stopped. Each member's value is the sentence it prints (the progress bar's last
    line, the log's "stopped: ..." and ``result.json``'s ``stop_reason``), its fields filled by
    :meth:`sentence`. Decided in one place per kind (``app/engine/loop.py``): ``Training.should_stop``
    after each optimizer step, the budget at an epoch's end, early stopping at an evaluation, the
    signal's name in ``fit``."""

    max_steps = "reached trainer.max_steps ({total_steps} optimizer steps)"
    max_epochs = "reached trainer.max_epochs ({epochs}, {total_steps} optimizer steps)"
    no_improvement = "{monitor} did not improve for {evaluations} evaluations (best {best})"
    non_finite_loss = NON_FINITE_LOSS + " {loss} at step {step}"
    interrupted = "interrupted"
    """A signal reached a process; once the processes agree which signal, ``signalled`` says it."""
    signalled = "interrupted by {signal} at step {step}"
    another_process = "stop requested by another process"
    pruned = "{why}"
    """A pruned sweep's pruner stopped the trial; its link (``Components.pruning``) says why."""

    def sentence(self, **fields: Any) -> str:
        return str(self.value).format(**fields)
