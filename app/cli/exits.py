"""How ``python -m app`` ends: refused input in one sentence and exit 2, a failed run in one sentence
and exit 1, a signal outside training in one sentence and 128 + the signal, and every end without
the interpreter's teardown. Torch-free."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

from app.console.logs import to_log_files
from app.interrupts import Interrupted

log = logging.getLogger("app")


def fail(message: str, exit_code: int = 2) -> NoReturn:
    """One sentence on stderr, once, then a non-zero exit: 2, bad input (``app.cli.job.main`` then takes
    back what the run's start wrote), or 1, a run that failed (the sentence also goes to its log file)."""
    if exit_code != 2:
        to_log_files(log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), None))
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


def exit_interrupted(err: Interrupted) -> NoReturn:
    """A signal outside the training loop: one sentence (in the run's log too, once there is one),
    then 130 (SIGINT) / 143 (SIGTERM)."""
    if logging.getLogger().handlers:
        log.warning("%s", err)
    else:
        print(err, file=sys.stderr)
    # torch's default (WARNING) for its loggers, which an import cut short leaves unset: its exit
    # hooks would log cache statistics at INFO after the sentence.
    logging.getLogger("torch").setLevel(logging.WARNING)
    sys.exit(err.exit_code)


def exit_without_teardown(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, minus the interpreter's teardown, which with torch
    loaded takes about a second (collecting every module's objects, then torch's C++ static
    destructors) and only frees memory the exit frees anyway. What Python does before that teardown
    is done here, by the same calls: threading's exit hooks and the join of non-daemon threads
    (executors of joblib/concurrent.futures stop there), the atexit handlers (logging closes its
    files, trackers and the fork server end), the flush of the output."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
