"""The terminal and the pipes: what the run's human output may hold where it goes. Torch-free: the
launcher sets it up before any heavy import.

- **A terminal** gets live progress bars, redrawn in place, and colours.
- **A file or a pipe** gets plain lines only: no bar redraws, no carriage returns, no escape
  sequences. The bars become one log line every tenth of the run (``app.engine.progress``), and
  ``NO_COLOR`` is set for the libraries that colour their logs (Optuna's colorlog among them).
- **A closed pipe** never fails a run. ``python -m app ... | tee run.log``: the terminal's Ctrl-C
  ends ``tee`` as well, and the run's next write to it would raise ``BrokenPipeError`` wherever it
  happens to be (the bar, a log line, the signal's own message), failing the run before its
  checkpoint. The first write that finds the pipe closed points that descriptor at ``/dev/null``
  instead, so this write and every later one (Python's, a signal handler's, C code's) is dropped;
  the run's ``app.log`` keeps everything.
- **The jobs of a sweep run one after another in one process** (Hydra's basic launcher, under the grid
  and Optuna sweepers): the first prints its config tree, the later ones keep theirs to their own
  ``app.log`` (Hydra's launcher line, ``#3 : optim.lr=...``, says what each job changes; every job's
  ``.hydra/`` holds its whole config) (:func:`enter_sweep_job`, :func:`tree_shown_before`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any, TextIO

from app.console.logs import in_parallel_job, log_to_stream


def silence(fd: int) -> None:
    """Point ``fd`` at /dev/null: everything written to it from now on is dropped without an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def write_raw(fd: int, text: str) -> None:
    """``os.write`` for signal handlers and other places that bypass ``sys.stderr``: a closed pipe
    (or a stream already gone) drops the text instead of raising into whatever the process was doing."""
    try:
        os.write(fd, text.encode())
    except OSError as err:
        if err.errno == errno.EPIPE:
            with contextlib.suppress(OSError):
                silence(fd)


class ClosedPipeSafe:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose writes never raise ``BrokenPipeError``:
    the first one silences the descriptor (:func:`silence`), and the text is dropped. Everything
    else (``isatty``, ``fileno``, ``encoding``...) is the stream's own."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._closed()

    def _closed(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            silence(self.stream.fileno())
            self.stream.flush()  # what the failed write left in the buffer goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def protect_output() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` safe against a closed pipe (once per process), and,
    when stderr is not a terminal, ask colouring libraries for plain text (``NO_COLOR``; a user's
    ``FORCE_COLOR`` still wins) and the datasets library for no bars."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ClosedPipeSafe):
            safe = ClosedPipeSafe(stream)
            setattr(sys, name, safe)
            log_to_stream(stream, safe)  # handlers set up before (Hydra's, in a launcher's job process) too
    if not is_terminal(sys.stderr):
        if "FORCE_COLOR" not in os.environ:
            os.environ.setdefault("NO_COLOR", "1")
        # The datasets library's bars ("Generating train split", "Tokenizing ...") redraw with carriage returns.
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def draws_bars() -> bool:
    """Whether progress is drawn as live bars: on a terminal, outside a parallel sweep's job."""
    return is_terminal(sys.stderr) and not in_parallel_job()


_sweep_jobs_started = 0
"""Jobs of a sweep this process has started (Hydra's basic launcher runs them one after another in it)."""


def enter_sweep_job() -> None:
    """This process starts (another) job of a sweep."""
    global _sweep_jobs_started
    _sweep_jobs_started += 1


def in_sweep_job() -> bool:
    """Whether this process runs a job of a sweep (whose launcher line says the job's overrides)."""
    return _sweep_jobs_started > 0


def tree_shown_before() -> bool:
    """Whether an earlier job of the sweep this process runs has printed its config tree already."""
    return _sweep_jobs_started > 1


def announce(line: str) -> None:
    """One whole line on the terminal (in one write, so that parallel jobs' lines never interleave)."""
    stream = sys.stdout
    with contextlib.suppress(OSError, ValueError):
        stream.write(line.rstrip("\n") + "\n")
        stream.flush()


