"""Run a test function on real worker processes (gloo, CPU) with the app's own launcher.

Worker functions must be module-level (the processes are spawned and import them by name) and
return picklable values; ``on_processes`` returns them in rank order. An exception on any rank fails
the call with :class:`app.workers.elastic.WorkerFailed` naming the rank and the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.workers.processes import run_on_processes

TIMEOUT_S = 60.0
"""Collective timeout inside test workers: a broken collective fails the test instead of hanging it."""


def on_processes(fn: Callable[..., Any], *args: Any, nprocs: int = 2) -> list[Any]:
    return run_on_processes(fn, args, nprocs=nprocs)


def ddp_backend() -> Any:
    from app.distributed.backends.torch_distributed import DDPBackend

    return DDPBackend.from_environment(timeout_s=TIMEOUT_S)


def fsdp_backend(reshard_after_forward: bool = True) -> Any:
    from app.distributed.backends.torch_distributed import FSDPBackend

    return FSDPBackend.from_environment(timeout_s=TIMEOUT_S, reshard_after_forward=reshard_after_forward)
