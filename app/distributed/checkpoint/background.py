"""Checkpoints written while training goes on (``Accelerator.save_state(async_save=True)``): the
:class:`BackgroundWriter` an Accelerator owns runs one checkpoint write at a time on a thread of its
own, after the state was copied off the device (``staging``).

What keeps an asynchronous save as safe as a synchronous one:

- The write is the same commit: files, fsync, the manifest last, the rename, then rotation (on the
  main process): a crash or SIGKILL while it runs leaves the previous checkpoint the newest complete
  one, and rotation only ever runs after its successor is complete.
- The next save, a ``load_state``, ``wait_for_checkpoint`` and ``end_training`` first wait for the
  write in flight; its error (one sentence) is raised there, on the main thread, once.
- Waiting is a loop of short joins: CPython runs signal handlers only on the main thread, between
  bytecodes, so a Ctrl-C or SIGTERM during the wait is handled at once (a second Ctrl-C still exits
  at once). The writer thread blocks those signals, so the kernel delivers them to another thread.
- The thread is not a daemon: a process that ends without waiting still finishes the write (the
  interpreter joins it at exit); only a kill cuts it short, which the commit is made for.
- Several processes: each rank's writer writes its own files, the writers agree on the outcome over a
  process group of their own (``Backend.background_collectives``), never the training's, and rank 0
  commits only once every rank's part is on disk.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.05
"""How long one join of the writer waits before the main thread looks at its signals again."""
_BLOCKED = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
            if hasattr(signal, name)}


class WriterCollectives(Protocol):
    """What the ranks' checkpoint writers run between themselves (on one process: identities)."""

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int) -> Any: ...

    def barrier(self) -> None: ...


class BackgroundWriter:
    """At most one checkpoint write in flight; :meth:`wait` for it. ``buffers``: the host copies of the
    last asynchronous save, reused by the next (``staging.Staging``)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._folder: Path | None = None
        self._error: BaseException | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.said_too_large = False
        """Whether the log already said that a save was too large to copy (said once)."""

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def start(self, write: Callable[[], Path]) -> None:
        """Run ``write`` (the commit of a staged checkpoint) on the writer thread, after the previous
        write (whose error is raised here)."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer")
        self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        if _BLOCKED:
            signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        try:
            self._folder = write()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, raised by wait()
            self._error = err

    def wait(self) -> Path | None:
        """Block until the write in flight is complete and return its folder (None: nothing was in
        flight); raise its error, once."""
        thread = self._thread
        if thread is None:
            return None
        while thread.is_alive():
            thread.join(WAIT_SLICE_S)
        self._thread = None
        error, self._error = self._error, None
        folder, self._folder = self._folder, None
        if error is not None:
            raise error
        return folder


def host_memory_available() -> int | None:
    """Bytes of memory the kernel says are available to new allocations (Linux), else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits_in_host_memory(nbytes: int) -> tuple[bool, int | None]:
    """Whether one more copy of ``nbytes`` leaves at least half of the available host memory free
    (and what is available; None: unknown, then it is assumed to fit)."""
    available = host_memory_available()
    return available is None or nbytes <= available // 2, available
