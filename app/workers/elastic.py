"""Start N local worker processes with torch's elastic launcher, and say which rank's error to show
when one fails. Below its users (``app.workers.processes``, behind ``python -m app``'s workers, and
``app.distributed.notebook_launcher``) and torch-free until a process is started.

:func:`start_processes` is the one place that turns a layout into torch's ``LaunchConfig``.

Which rank's error: when one rank raises or dies, its peers usually fail a moment later inside a
collective ("Connection reset by peer"), and the launcher reports whichever failure it notices first.
Two measures make the report name the real cause: a rank whose error only says that a peer vanished
waits briefly before exiting, so the launcher sees the peer's failure first; and among the
failures reported, those are ranked last.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a worker has failed, not when the app starts
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# What gloo, nccl and c10d say when the other side of a collective went away.
PEER_LOSS_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                     "communicator was aborted", "remote process exited", "DistNetworkError", "DistBackendError")
PEER_LOSS_GRACE_S = 3.0


class WorkerFailed(RuntimeError):
    """A worker process raised or died; the message names the rank and its error in one line."""

    def __init__(self, message: str, traceback: str | None = None):
        super().__init__(message)
        self.traceback = traceback


def is_peer_loss(text: str) -> bool:
    return any(marker in text for marker in PEER_LOSS_MARKERS)


def call_blaming_the_cause(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; if it fails only because a peer vanished, wait a little before re-raising."""
    try:
        return fn(*args)
    except Exception as err:
        if is_peer_loss(f"{type(err).__name__}: {err}"):
            time.sleep(PEER_LOSS_GRACE_S)
        raise


def worker_failure(err: ChildFailedError) -> WorkerFailed:
    """The root cause among the reported failures: not a peer-loss error (a rank killed by a signal
    records no time of its own, so time alone could blame the survivor), then the earliest."""

    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return is_peer_loss(_message(failure)), failure.timestamp, rank

    rank, failure = min(err.failures.items(), key=key)
    data = failure.error_file_data.get("message")
    traceback = data.get("extraInfo", {}).get("py_callstack") if isinstance(data, dict) else None
    message = _message(failure)
    if not message or message.startswith("To enable traceback"):
        message = f"exited with code {failure.exitcode} without recording an error"
    return WorkerFailed(f"rank {rank} failed: {message}", traceback)


def _message(failure: Any) -> str:
    message = failure.message
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    return text.strip().splitlines()[0] if text.strip() else ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (as the launcher's store will bind it, address reuse on:
    a port left in TIME_WAIT by an earlier launch counts as free; one still listening does not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def local_port(host: str, wanted: int) -> int:
    """``wanted`` if it is free, else a free port: for a launch whose processes all run on this machine,
    where no other machine needs to know the port (a notebook cell run twice, Accelerate's test
    scripts calling ``notebook_launcher`` in a row, another job on the default 29500)."""
    return wanted if port_is_free(host, wanted) else free_port()


def start_processes(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, *, start_method: str,
                    num_nodes: int = 1, rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None,
                    rdzv_configs: dict[str, Any] | None = None, run_id: str | None = None, max_restarts: int = 0,
                    monitor_interval: float = 0.1, signals: str | None = None,
                    shutdown_timeout: int | None = None, log_dir: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` processes of this machine (``num_nodes`` machines in all) and
    return what each returned, in local rank order. When one raises or dies the launcher stops the
    others and this raises :class:`WorkerFailed` for the root cause (``worker_failure``).

    ``rdzv_endpoint`` None: a free local port; ``run_id`` None: a fresh one. ``signals``: the ones
    torch's launcher handles by stopping the workers (None: its default). ``shutdown_timeout``: how
    long the survivors of a failure get after SIGTERM (None: torch's default). ``log_dir``: where the
    launcher keeps each rank's error file (None: a folder of its own)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    options: dict[str, Any] = {}
    if signals is not None:
        # Older torch reads the variable only; newer sets it from LaunchConfig.signals_to_handle.
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals
        if "signals_to_handle" in LaunchConfig.__dataclass_fields__:
            options["signals_to_handle"] = signals
    if shutdown_timeout is not None:
        options["shutdown_timeout"] = shutdown_timeout
    if log_dir is not None:
        options["logs_specs"] = DefaultLogsSpecs(log_dir=log_dir)
    config = LaunchConfig(
        **options,
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=nprocs,
        run_id=run_id if run_id is not None else f"app-{uuid.uuid4().hex[:8]}",
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint if rdzv_endpoint is not None else f"localhost:{free_port()}",
        rdzv_configs=dict(rdzv_configs or {}),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
    )
    # The launcher's own INFO lines (configs, rendezvous) are noise next to the run's log.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    try:
        results = elastic_launch(config, fn)(*args)
    except ChildFailedError as err:
        raise worker_failure(err) from None
    return [results[rank] for rank in sorted(results)]
