"""The workers of ``python -m app`` (:func:`run_on_processes`, also used by the tests and the
benchmarks): N local processes started by ``app.workers.elastic.start_processes`` (the one place that
turns a layout into torch's ``LaunchConfig``, also behind ``app.distributed.notebook_launcher``) from a
fork server, watched so that a failed or hung rank is named (:class:`~app.workers.elastic.WorkerFailed`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app import this_process
from app.interrupts import STOP_SIGNALS
from app.workers.elastic import WorkerFailed, call_blaming_the_cause, start_processes
from app.workers.watchdog import Watchdog, record_pid

SHUTDOWN_GRACE_S = 5.0
"""How long the other workers of a failed run get to exit by themselves before SIGKILL."""
ALL_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""What torch's launcher handles by default: it stops the workers on any of them."""


def run_on_processes(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int,
                     collective_timeout_s: float | None = None, leave_stop_signals: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes (the workers of ``python -m app``); returns
    each rank's return value in rank order.

    When a rank raises or dies the launcher stops the others (``max_restarts=0``) and this raises
    :class:`WorkerFailed` naming the failing rank and its error; a rank that hung (the others'
    collectives timed out) is killed :data:`SHUTDOWN_GRACE_S` after the first failure and named
    instead (``app.workers.watchdog``). Used by ``launch``, the tests and the benchmarks.

    ``leave_stop_signals``: SIGINT and SIGTERM stay with the caller's handlers (torch's launcher would
    kill the workers a few seconds after either; ``launch`` lets them finish a checkpoint instead).
    """
    # The launcher keeps each rank's error file there; nothing else of it outlives the run.
    logs = tempfile.TemporaryDirectory(prefix="app-launch-")
    pid_dir = Path(logs.name) / "pids"
    pid_dir.mkdir()
    watchdog = Watchdog(Path(logs.name), pid_dir, grace_s=SHUTDOWN_GRACE_S)
    watchdog.start()
    start_worker_server()  # when launch did not already
    try:
        return start_processes(
            _entry, (fn, args, str(pid_dir)), nprocs, start_method=_start_method(),
            signals="SIGHUP,SIGQUIT" if leave_stop_signals else ALL_SIGNALS, log_dir=logs.name,
            # Survivors of a failed rank get this long to exit after SIGTERM, then SIGKILL (the agent's
            # own stop; the watchdog bounds the one its process context does with 30 s).
            shutdown_timeout=int(SHUTDOWN_GRACE_S))
    except WorkerFailed as failure:
        hung = watchdog.hung_ranks_message(collective_timeout_s)
        if hung is not None and any(word in str(failure).lower() for word in ("timed out", "timeout")):
            raise WorkerFailed(hung, failure.traceback) from None
        raise
    finally:
        watchdog.stop()
        logs.cleanup()


WORKER_PRELOAD = ["app.engine.run", "app.tasks.digits.task", "app.tasks.text.task", "torch._dynamo"]
"""What the fork server imports once for all workers: the engine, the tasks (without their optional
libraries), and ``torch._dynamo``, which torch.optim imports on an optimizer's creation and first
step whether or not anything is compiled (about as long as importing torch itself)."""


def _start_method() -> str:
    """Workers are forked from a fork server that has imported torch and the engine once (not
    from this process, whose threads and OpenMP state a fork would copy), so a worker starts in a
    fraction of a second instead of re-importing everything; also across the jobs of a sweep.

    Workers see the environment of the moment the server started, plus the launcher's variables.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(WORKER_PRELOAD)
    return "forkserver"


def start_worker_server() -> None:
    """Start the fork server now (it lives as long as this process, one for all the jobs of a sweep):
    its imports then run on another core while this process validates the config and prepares the
    launch, instead of after it.

    It starts with SIGINT, SIGTERM and SIGUSR1 blocked: a Ctrl-C reaches every process of the
    terminal's group (SLURM's signals every process of the job), and a fork server stopped in its
    imports would print a traceback and fail the launch (SIGUSR1's default action kills). Blocked, not
    ignored, so that one arriving meanwhile still reaches this process once the server is started; the
    workers inherit the mask and unblock them (``_entry``). The resource tracker ignores SIGINT and
    SIGTERM itself; it starts with SIGUSR1 blocked."""
    if _start_method() != "forkserver":
        return
    from multiprocessing import forkserver, resource_tracker

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        # Started by the fork server otherwise; it unblocks SIGINT and SIGTERM after, hence first.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()  # the signal mask is kept across fork and exec
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    atexit.unregister(_stop_worker_server)
    atexit.register(_stop_worker_server)


def _stop_worker_server() -> None:
    """At exit, end the fork server at once: one still importing (the config was refused, or a signal
    stopped the launch) would otherwise run on for seconds, holding the terminal's output. (It
    serves no one any more; its workers have ended, and it blocks SIGTERM: SIGKILL.)"""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)  # private, hence getattr
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], pid_dir: str | None = None) -> Any:
    """What each launched process runs. The launcher wraps it in ``record``, which writes an
    exception's traceback to the error file the parent reads (``worker_failure``)."""
    # The fork server blocks them (start_worker_server): a worker reacts like any Python process.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    from app.console.output import protect_output

    protect_output()  # a rank's output to a pipe that Ctrl-C closed (| tee) is dropped; the rank goes on
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # As torchrun does: processes sharing a machine must not each use every core.
        torch.set_num_threads(max(1, this_process.available_cores() // this_process.local_world_size()))
    record_pid(pid_dir, this_process.rank())
    return call_blaming_the_cause(fn, *args)
