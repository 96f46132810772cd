"""A fault-injection point for drills and tests: make one rank raise in the middle of training.

``APP_FAIL_AT_STEP=<optimizer step>`` (and ``APP_FAIL_RANK=<rank>``, default 0) make that rank raise
:class:`InjectedFault` right after that optimizer step, to check that a run with a failing rank exits
non-zero promptly, showing the error, instead of hanging. Unset, it costs nothing per step.
"""

from __future__ import annotations

import os
from collections.abc import Callable


class InjectedFault(RuntimeError):
    pass


def fault_point(rank: int) -> Callable[[int], None]:
    """A per-step check for this rank; a no-op unless APP_FAIL_AT_STEP is set."""
    at_step = os.environ.get("APP_FAIL_AT_STEP")
    if at_step is None or int(os.environ.get("APP_FAIL_RANK", "0")) != rank:
        return lambda step: None

    def check(step: int) -> None:
        if step == int(at_step):
            raise InjectedFault(f"injected fault on rank {rank} at step {step} (APP_FAIL_AT_STEP={at_step})")

    return check
