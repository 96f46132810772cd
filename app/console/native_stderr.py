"""Native notices off the terminal: lines a hardware kind's C++ runtime writes to stderr that say
nothing to the user (torch_xla's) go to the run's ``app.log``; every other line a library writes
there, a real error included, still reaches the terminal (:func:`native_stderr_to_log`)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from app.console.output import ClosedPipeSafe

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
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        relay = subprocess.Popen(
            [sys.executable, "-S", "-c", "from app.console.native_stderr import relay_native_stderr; relay_native_stderr()",
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
