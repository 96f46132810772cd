"""Ctrl-C and preemption: the first SIGINT, SIGTERM or SIGUSR1 asks training to stop after the current
optimizer step (the loop then saves a checkpoint, also when periodic checkpoints are off, and the run
exits with 128 + the signal: 130 / 143 / 138); a second SIGINT exits at once, without a checkpoint
(every arrival counts: :class:`DeliveryLog`). Outside the loop (setup: imports, data, process group,
resume), the first signal stops the process where it is, with one sentence and the same exit status
(:func:`interrupt_outside_training`). The handlers only record the signal: the checkpoint is written
by the loop, after the step, never inside a handler.

SLURM and Kubernetes send SIGTERM before killing; SLURM sends SIGUSR1 before a time limit
(``--signal=USR1@<s>``) and with ``scancel --signal=USR1`` (after which the job requeues itself:
``app.launching.slurm_requeue``); a terminal's Ctrl-C reaches every process of the job. When only the
launcher is signalled (``python -m app hardware=multi_cpu`` started the workers), it writes the signal
into a *stop file* the workers look at after every step. The ranks agree on the step to stop at
through the backend's step flag (``app/distributed/step_flags.py``: an asynchronous host all-reduce per
step, read one step later).

Torch-free: the launcher uses it before any heavy import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from app.console.output import write_raw

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class RunInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint; the process exits with ``exit_code``."""

    def __init__(self, signum: int, step: int, run_dir: str):
        super().__init__(signum, step, run_dir)
        self.signum, self.step, self.run_dir = signum, step, run_dir

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return (f"interrupted ({signal_name(self.signum)}) at step {self.step}; resume with: "
                f"python -m app resume={self.run_dir}")


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGUSR1 outside the training loop (during setup: imports, data, process group,
    resume): raised where the signal lands, so setup stops at once; the process exits with
    ``exit_code`` and one sentence. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` takes it for a failure."""

    def __init__(self, signum: int, stage: str = "before the first training step; nothing was trained or saved"):
        super().__init__(signum, stage)
        self.signum, self.stage = signum, stage

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"interrupted ({signal_name(self.signum)}) {self.stage}."


def interrupt_outside_training() -> None:
    """From now on, the first SIGINT, SIGTERM or SIGUSR1 raises :class:`Interrupted` in the main thread and a
    second SIGINT exits at once (KeyboardInterrupt's traceback, or SIGTERM's silent death, otherwise).
    The training loop's :class:`StopSignals` replaces the handlers while it runs and gives them back.
    A signal this process was started to ignore (``nohup``, a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _raise_interrupted)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _raise_interrupted:
            signal.signal(sig, _exit_at_once)  # while the first one unwinds
    raise Interrupted(signum)


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        exit_now(signum, "\nsecond interrupt: exiting now\n")


def exit_now(signum: int, message: str, end_children: bool = True) -> None:
    """Say ``message`` and exit with 128 + ``signum`` at once, without unwinding.

    ``end_children``: SIGKILL this process's multiprocessing children (its DataLoader workers) first.
    A worker hands each batch's tensors over as file descriptors (multiprocessing's resource sharer,
    torch's default sharing strategy); an exit that cuts that handshake made the worker's sharer thread
    print a ConnectionResetError traceback on the terminal, once the prompt was back. Killed first, a
    worker writes nothing more. A launcher leaves its ranks to end themselves (the terminal's Ctrl-C
    reaches them too, and each ends its own workers). Called in the main thread (a signal handler)."""
    write_raw(2, message)
    if end_children:
        import multiprocessing

        # torch's DataLoader raises from its SIGCHLD handler when a worker dies: not this time.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGKILL)
    os._exit(128 + signum)


class StopSignals:
    """Installs the handlers for the block (main thread only; elsewhere it only reads the stop file).

    ``stop_file``: written by the launcher when it is signalled (``forward=True``), read by the workers.
    ``announce``: this process says on stderr what happens next (the main process only).
    """

    def __init__(self, stop_file: Path | None = None, forward: bool = False, announce: bool = True):
        self.stop_file = stop_file
        self.forward = forward
        self.announce = announce
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._deliveries: DeliveryLog | None = None
        self._owner: int | None = None  # the process that installed the handlers (__enter__)

    def __enter__(self) -> StopSignals:  # noqa: PYI034 - not subclassed
        self._owner = os.getpid()
        if threading.current_thread() is threading.main_thread():
            self._deliveries = DeliveryLog.install()
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._deliveries is not None:
            self._deliveries.uninstall()
            self._deliveries = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            # A forked child (a DataLoader worker: a terminal's Ctrl-C reaches it too) inherited this
            # handler. It goes on serving batches; the process that installed the handler stops the run.
            return
        delivered = self._deliveries.drain() if self._deliveries is not None else []
        # Python runs a handler once however many times its signal arrived while the main thread was
        # in C code (a checkpoint's write, a long kernel): the delivery log has each arrival.
        for sig in delivered or [signum]:
            self._on_signal(sig)

    def _on_signal(self, signum: int) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                # A second Ctrl-C: the user does not want to wait for the checkpoint.
                exit_now(signum, "\nsecond interrupt: exiting now, without a checkpoint\n", end_children=not self.forward)
            return
        self.signum = signum
        if self.forward and self.stop_file is not None:
            self.stop_file.write_text(str(signum))
        if self.announce:
            write_raw(2, f"\n{signal_name(signum)}: stopping after the current step and saving a checkpoint "
                         "(Ctrl-C again to exit at once)\n")

    @property
    def received(self) -> int | None:
        """The signal this process (or, through the stop file, its launcher) received, if any."""
        if self.signum is None and self.stop_file is not None and self.stop_file.exists():
            text = self.stop_file.read_text().strip()
            self.signum = int(text) if text.isdigit() else signal.SIGTERM
        return self.signum


class DeliveryLog:
    """Every arrival of a stop signal, in order, from the moment it is installed.

    CPython's C-level handler only sets a flag per signal and runs the Python handler later, in the
    main thread, once: two Ctrl-C pressed while the main thread is inside one long C call would read as
    one. The same C handler also writes the signal's number, once per arrival, to the *wakeup fd*
    (:func:`signal.set_wakeup_fd`); this pipe is that fd. Installed only where no other wakeup fd is
    set (an event loop's stays as it is, and the handler falls back to one arrival per call). A forked
    child (a DataLoader worker, which a terminal's Ctrl-C reaches too) lets go of it at once, or its
    arrivals would be counted as the parent's."""

    active: DeliveryLog | None = None  # the one whose pipe is this process's wakeup fd

    def __init__(self, read_fd: int, write_fd: int):
        self._fds: tuple[int, int] | None = (read_fd, write_fd)

    @classmethod
    def install(cls) -> DeliveryLog | None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous == -1:
            cls.active = cls(read_fd, write_fd)
            return cls.active
        signal.set_wakeup_fd(previous)  # someone else's (an event loop's): theirs stays
        os.close(read_fd)
        os.close(write_fd)
        return None

    def drain(self) -> list[int]:
        """The stop signals that arrived since the last call, oldest first."""
        data = b""
        while self._fds is not None:
            try:
                chunk = os.read(self._fds[0], 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        return [sig for sig in data if sig in STOP_SIGNALS]

    def uninstall(self) -> None:
        if self._fds is None:
            return
        if DeliveryLog.active is self:
            DeliveryLog.active = None
            signal.set_wakeup_fd(-1)
        for fd in self._fds:
            os.close(fd)
        self._fds = None

    @classmethod
    def _let_go_in_child(cls) -> None:
        if cls.active is not None:
            cls.active.uninstall()


os.register_at_fork(after_in_child=DeliveryLog._let_go_in_child)
