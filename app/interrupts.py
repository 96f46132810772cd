"""Ctrl-C and preemption: the first SIGINT or SIGTERM asks training to stop after the current optimizer
step (the loop then saves a checkpoint and the run exits with 128 + the signal: 130 / 143); a second
SIGINT exits at once, without a checkpoint. Outside the loop (setup: imports, data, process group,
resume), the first signal stops the process where it is, with one sentence and the same exit status
(:func:`interrupt_outside_training`).

SLURM and Kubernetes send SIGTERM before killing; a terminal's Ctrl-C reaches every process of the
job. When only the launcher is signalled (``python -m app hardware=multi_cpu`` started the workers),
it writes the signal into a *stop file* the workers look at after every step. The ranks agree on the
step to stop at through the backend's step flag (``app/distributed/step_flags.py``: an asynchronous
host all-reduce per step, read one step later).

Torch-free: the launcher uses it before any heavy import.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    """SIGINT or SIGTERM outside the training loop (during setup: imports, data, process group,
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
    """From now on, the first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread and a
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
        os.write(2, b"\nsecond interrupt: exiting now\n")
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

    def __enter__(self) -> StopSignals:  # noqa: PYI034 - not subclassed
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                # A second Ctrl-C: the user does not want to wait for the checkpoint.
                os.write(2, b"\nsecond interrupt: exiting now, without a checkpoint\n")
                os._exit(128 + signum)
            return
        self.signum = signum
        if self.forward and self.stop_file is not None:
            self.stop_file.write_text(str(signum))
        if self.announce:
            os.write(2, f"\n{signal_name(signum)}: stopping after the current step and saving a checkpoint "
                        "(Ctrl-C again to exit at once)\n".encode())

    @property
    def received(self) -> int | None:
        """The signal this process (or, through the stop file, its launcher) received, if any."""
        if self.signum is None and self.stop_file is not None and self.stop_file.exists():
            text = self.stop_file.read_text().strip()
            self.signum = int(text) if text.isdigit() else signal.SIGTERM
        return self.signum
