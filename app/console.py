"""Where the run's human output goes, and what it may hold there. Torch-free: the launcher sets it up
before any heavy import.

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
- **Details** (each checkpoint saved, loaded or rotated away) are logged at DEBUG: they go to the
  run's ``app.log`` only, unless Hydra's ``hydra.verbose`` asks for debug lines on the terminal too
  (:func:`details_to_log_file`).
- **A job of a parallel sweep launcher** (joblib runs several jobs on one terminal at once) writes
  its config tree, progress and log lines to its own ``app.log``; the terminal gets one line when the
  job starts and one when it ends (:func:`enter_parallel_job`, :func:`announce`).
- **Native notices** (lines a hardware kind's C++ runtime writes to stderr that say nothing to the
  user, such as torch_xla's) go to ``app.log``; every other line a library writes there, a real
  error included, still reaches the terminal (:func:`native_stderr_to_log`).
- **The jobs of a sweep run one after another in one process** (Hydra's basic launcher, under the grid
  and Optuna sweepers): the first prints its config tree, the later ones keep theirs to their own
  ``app.log`` (Hydra's launcher line, ``#3 : optim.lr=...``, says what each job changes; every job's
  ``.hydra/`` holds its whole config) (:func:`enter_sweep_job`, :func:`tree_shown_before`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

PARALLEL_JOB_ENV = "APP_PARALLEL_JOB"
"""Set (to the job's number) in a job of a parallel launcher, for its worker processes too."""


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
            # Handlers set up before (Hydra's, in a launcher's job process) write through it too.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                    handler.setStream(safe)  # type: ignore[arg-type]
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


def in_parallel_job() -> bool:
    return PARALLEL_JOB_ENV in os.environ


def draws_bars() -> bool:
    """Whether progress is drawn as live bars: on a terminal, outside a parallel sweep's job."""
    return is_terminal(sys.stderr) and not in_parallel_job()


def enter_parallel_job(number: int) -> None:
    """This process runs one job of a parallel launcher: from now on its log (and the worker processes
    it starts) write to the run's ``app.log`` only, never to the terminal the jobs share."""
    os.environ[PARALLEL_JOB_ENV] = str(number)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)


_DETAILS_OPENED = "_app_details_to_log_file"
"""Set on the ``app`` logger by :func:`details_to_log_file`: its DEBUG level is ours, not the user's."""


def details_to_log_file() -> None:
    """The app's DEBUG lines reach the log file but not the terminal: the ``app`` loggers let them
    through, the root's other handlers stay at INFO. Left as it is when debug lines were asked for
    (``hydra.verbose=app`` or ``true``: they show on the terminal as well). Called again for every job
    of a sweep, whose handlers Hydra makes anew (the ``app`` logger keeps the level set for the first
    job: that is no request for debug lines)."""
    app_log = logging.getLogger("app")
    if app_log.isEnabledFor(logging.DEBUG) and not getattr(app_log, _DETAILS_OPENED, False):
        return
    app_log.setLevel(logging.DEBUG)
    setattr(app_log, _DETAILS_OPENED, True)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(max(handler.level, logging.INFO))


_sweep_jobs_started = 0
"""Jobs of a sweep this process has started (Hydra's basic launcher runs them one after another in it)."""


def enter_sweep_job() -> None:
    """This process starts (another) job of a sweep."""
    global _sweep_jobs_started
    _sweep_jobs_started += 1


def tree_shown_before() -> bool:
    """Whether an earlier job of the sweep this process runs has printed its config tree already."""
    return _sweep_jobs_started > 1


def announce(line: str) -> None:
    """One whole line on the terminal (in one write, so that parallel jobs' lines never interleave)."""
    stream = sys.stdout
    with contextlib.suppress(OSError, ValueError):
        stream.write(line.rstrip("\n") + "\n")
        stream.flush()


RELAY_EXIT_WAIT_S = 10.0
"""How long the end of :func:`native_stderr_to_log` waits for its relay to pass on the last lines (it
ends as soon as every process writing to the pipe is gone; a child that outlives the run keeps it)."""


@contextlib.contextmanager
def native_stderr_to_log(notices: Sequence[str], log_file: str | None, source: str) -> Iterator[None]:
    """Inside the block, lines written to this process's stderr (fd 2) that contain one of ``notices``
    go to ``log_file`` (the run's ``app.log``, as ``[time][<source>][WARNING] - <line>``) instead of the
    terminal; every other line reaches the terminal as before.

    Native code (torch_xla's C++ runtime) writes to fd 2 itself, so fd 2 becomes a pipe, read by a
    small relay process that sorts the lines. A process of its own, because a real error is often the
    last thing a dying process writes (a failed check, then ``abort()``): the relay still reads it after
    the process is gone and passes it on. It starts in a session of its own and ignores the stop
    signals, so a terminal's Ctrl-C, which stops the run, does not stop it before the run's last lines.
    Python's own stderr (``sys.stderr``: warnings, tracebacks, progress bars) writes to the terminal
    directly, unfiltered (and stays a terminal for the bars). Nothing changes unless there are notices,
    a log file, and ``sys.stderr`` is :func:`protect_output`'s on fd 2 (the ``python -m app`` process)."""
    stream = sys.stderr
    if not notices or log_file is None or not isinstance(stream, ClosedPipeSafe) or _fileno(stream) != 2:
        yield
        return
    stream.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        relay = subprocess.Popen(
            [sys.executable, "-S", "-c", "from app.console import relay_native_stderr; relay_native_stderr()",
             log_file, source, *notices],
            stdin=read_end, stdout=terminal, stderr=terminal, env=env, start_new_session=True)
    except OSError:
        for fd in (read_end, write_end, terminal):
            os.close(fd)
        yield  # no relay: the notices stay on the terminal, nothing is lost
        return
    os.close(read_end)
    direct = io.TextIOWrapper(io.FileIO(terminal, "w", closefd=False), encoding=stream.encoding,
                              errors=stream.errors, write_through=True)
    python_side = stream.stream
    stream.stream = direct  # type: ignore[assignment]
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            direct.flush()
        stream.stream = python_side
        os.dup2(terminal, 2)  # this process's end of the pipe closes: the relay ends once it has read it all
        os.close(terminal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            relay.wait(RELAY_EXIT_WAIT_S)


def _fileno(stream: Any) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def relay_native_stderr() -> None:
    """The relay process of :func:`native_stderr_to_log` (``argv``: log file, source, notices...): each
    line of stdin that holds a notice is appended to the log file, every other line is written to stdout
    (the terminal), until every writer has closed the pipe."""
    log_file, source, *notices = sys.argv[1:]
    wanted = [notice.encode() for notice in notices]
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        log = open(log_file, "ab")  # noqa: SIM115 - held for the relay's life
    except OSError:
        log = None
    for line in iter(sys.stdin.buffer.readline, b""):
        if log is not None and any(notice in line for notice in wanted):
            now = time.time()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
            try:
                log.write(f"[{stamp}][{source}][WARNING] - ".encode() + line.rstrip(b"\r\n") + b"\n")
                log.flush()
                continue
            except OSError:
                pass  # the log cannot take it: the terminal does
        with contextlib.suppress(OSError):
            while line:
                line = line[os.write(1, line):]
