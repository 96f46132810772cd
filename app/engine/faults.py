"""A fault-injection point for drills and tests: make one rank fail in the middle of training.

``APP_FAIL_AT_STEP=<optimizer step>`` (and ``APP_FAIL_RANK=<rank>``, default 0) make that rank raise
:class:`InjectedFault` right after that optimizer step, to check that a run with a failing rank exits
non-zero promptly, showing the error, instead of hanging. With ``APP_FAIL_MODE=stop`` the rank
stops itself with SIGSTOP instead (a hung rank: it can neither fail nor answer SIGTERM). With
``APP_FAIL_MODE=hold`` it waits at each step of ``APP_FAIL_AT_STEP=<step>,<step>,...`` until the run
receives a stop signal (a run held at a known step, so that a test's signal reaches it there,
whenever it arrives). With ``APP_FAIL_MODE=refuse`` it refuses the run's input (a ``ConfigError``, exit 2)
at that step, as a rule that can only be checked once training runs would: the run folder must then be
left as it was before the start. Unset, it costs nothing per step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.interrupts import StopSignals

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    pass


def fault_point(rank: int, interrupts: StopSignals | None = None) -> Callable[[int], None] | None:
    """A per-step check for this rank; None (nothing to call) unless APP_FAIL_AT_STEP is set.
    ``interrupts``: what a hold waits on."""
    at_step = os.environ.get("APP_FAIL_AT_STEP")
    if at_step is None or int(os.environ.get("APP_FAIL_RANK", "0")) != rank:
        return None
    mode = os.environ.get("APP_FAIL_MODE")
    steps = {int(step) for step in at_step.split(",")}

    def check(step: int) -> None:
        if step not in steps:
            return
        if mode == "stop":
            log.warning("injected hang: rank %d (process %d) stops itself at step %d", rank, os.getpid(), step)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if mode == "hold":
            log.warning("injected hold: rank %d (process %d) waits at step %d for a stop signal", rank,
                        os.getpid(), step)
            while interrupts is not None and interrupts.received is None:
                time.sleep(0.01)  # the signal handlers run here
            return
        if mode == "refuse":
            from app.config import ConfigError

            raise ConfigError(f"injected refusal on rank {rank} at step {step} (APP_FAIL_MODE=refuse).")
        raise InjectedFault(f"injected fault on rank {rank} at step {step} (APP_FAIL_AT_STEP={at_step})")

    return check
