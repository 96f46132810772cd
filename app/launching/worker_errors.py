"""Which rank's error to show when a multi-process run fails.

When one rank raises or dies, its peers usually fail a moment later inside a collective
("Connection reset by peer"), and the launcher reports whichever failure it notices first. Two
measures make the report name the real cause: a rank whose error only says that a peer vanished
waits briefly before exiting, so the launcher sees the peer's failure first; and among the
failures reported, those are ranked last.
"""

from __future__ import annotations

import time
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
