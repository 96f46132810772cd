"""Where log records go: the one module that changes the logging handlers (who writes where, at
which level, through which filters). Torch-free, and nothing here imports the libraries it quiets.

- **Hydra's job logging** sets up the process that ran Hydra: the terminal and the run's ``app.log``.
  The app's DEBUG lines (each checkpoint saved, loaded or rotated away) reach ``app.log`` only, unless
  ``hydra.verbose`` asks for them on the terminal too (:func:`details_to_log_file`).
- **A worker process** gets its handlers here: rank 0 logs INFO to stdout and appends to ``app.log``,
  the other ranks log warnings to stderr (:func:`configure_worker_logging`).
- **A job of a parallel sweep launcher** (joblib runs several jobs on one terminal at once) logs to its
  own ``app.log`` only; the terminal gets one line when the job starts and one when it ends
  (:func:`enter_parallel_job`; ``app.console.output.announce``).
- **A progress bar on the terminal**: while it is shown, console records are written above it through
  tqdm, at the console handler's level and with its filters (:func:`console_records_above_bar`).
- **Other libraries' chatter** is kept off the terminal: what they say goes to the run's ``app.log``, in
  plain text, and only their errors reach the terminal (:func:`library_logs_to_log_file`). Each library
  is routed when (if ever) it is imported:

  - **transformers** prints through a handler of its own on stderr (propagation off): the load report
    (``BertForSequenceClassification LOAD REPORT`` with raw ANSI bold, the heads it initialised), and
    its ``Loading weights`` and ``Writing model shards`` bars, the latter glued onto our
    ``exported … to …/model`` line in a redirected output. Once ``transformers.utils.logging`` is
    imported (by anyone), its own handler is removed, its records propagate to ours, and its bars are
    off (huggingface_hub's download bars are not its own: they stay).
  - **MLflow** configures a handler of its own too (``Creating initial MLflow database tables...``):
    ``MLFLOW_CONFIGURE_LOGGING=false`` (unless the user set it) lets its records, and alembic's, reach ours.
  - **Deprecation warnings** (``DeprecationWarning``, ``FutureWarning``) raised inside these libraries'
    files (peft's use of a transformers API deprecated for v6) are logged, not printed.
  - On every handler that is not a file (the terminal's; a worker rank's stderr), a filter drops the
    records of these libraries below ERROR; a file handler keeps them, with ANSI sequences removed.
    Their errors, and every warning of the app, torch or the user's code, are untouched.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

PARALLEL_JOB_ENV = "APP_PARALLEL_JOB"
"""Set (to the job's number) in a job of a parallel launcher, for its worker processes too."""
WORKER_FORMAT = "[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s"
"""A worker's log line (Hydra's job logging's, with the rank)."""


def in_parallel_job() -> bool:
    return PARALLEL_JOB_ENV in os.environ


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


def configure_worker_logging(rank: int, log_file: str | None) -> None:
    """Rank 0 logs INFO to stdout and the run's log file; the others only warnings, to stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(WORKER_FORMAT.format(rank=rank))
    # In a parallel sweep's job the terminal is shared: the log goes to the run's log file only.
    handlers: list[logging.Handler] = [logging.NullHandler() if in_parallel_job() else
                                       logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0 and log_file is not None:
        handlers.append(logging.FileHandler(log_file, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0:
        details_to_log_file()
    library_logs_to_log_file()  # the libraries' chatter: to the log file (rank 0's), never to a terminal


def log_to_stream(old: Any, new: Any) -> None:
    """The handlers that write to ``old`` (``sys.stderr`` before it was made safe) write to ``new``."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(new)


def current_log_file() -> str | None:
    """The file Hydra's job logging writes (``<run folder>/app.log``), for the workers to append to."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def to_log_files(record: logging.LogRecord) -> None:
    """``record`` written to the log files only (a sentence the terminal gets on stderr already)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def close_log_files() -> None:
    """Close the handlers' log files (before a refused run takes its ``app.log`` back)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.close()


@contextlib.contextmanager
def console_records_above_bar(tqdm_class: Any) -> Iterator[None]:
    """Inside the block, console records are written through tqdm (above the bar, which stays whole):
    tqdm's stand-in for each console handler gets that handler's level and filters."""
    from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]

    root = logging.getLogger()
    before = list(root.handlers)
    consoles = [h for h in before if not isinstance(h, logging.FileHandler)]
    console_level = max((h.level for h in consoles), default=0)
    with logging_redirect_tqdm(tqdm_class=tqdm_class):
        for handler in root.handlers:
            if handler not in before:
                handler.setLevel(console_level)
                for kept in {f for console in consoles for f in console.filters}:
                    handler.addFilter(kept)
        yield


# -- other libraries' chatter ----------------------------------------------------------------------------------

LIBRARIES = ("transformers", "peft", "mlflow", "alembic", "datasets", "huggingface_hub")
"""The libraries whose logs and deprecation warnings stay off the terminal (logger names start so)."""
WARNINGS_LOGGER = "py.warnings"
"""Where a library's deprecation warning is logged (the name ``logging.captureWarnings`` uses), with the
library's name after it: ``py.warnings.transformers``."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def is_library_record(record: logging.LogRecord) -> bool:
    name = record.name.removeprefix(WARNINGS_LOGGER + ".")
    return name.split(".", 1)[0] in LIBRARIES


class OffTheTerminal(logging.Filter):
    """On a terminal's (or a stream's) handler: the libraries' records below ERROR are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not is_library_record(record)


class PlainText(logging.Filter):
    """On a file's handler: a library's record loses its ANSI sequences (transformers' bold titles)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_library_record(record):
            message = record.getMessage()
            if "\x1b" in message:
                record.msg, record.args = ANSI.sub("", message), None
        return True


def library_logs_to_log_file() -> None:
    """Route the libraries' output as the module docstring says, for the root's handlers as they are
    now (call it again after they are replaced: each sweep job's, a worker's). Idempotent."""
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    when_imported("transformers.utils.logging", _route_transformers)
    if not isinstance(warnings.showwarning, _LibraryWarnings):
        warnings.showwarning = _LibraryWarnings(warnings.showwarning)
    for handler in logging.getLogger().handlers:
        wanted: logging.Filter = PlainText() if isinstance(handler, logging.FileHandler) else OffTheTerminal()
        if not any(type(f) is type(wanted) for f in handler.filters):
            handler.addFilter(wanted)


def _route_transformers(hf_logging: ModuleType) -> None:
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


class _LibraryWarnings:
    """``warnings.showwarning`` that logs a library's deprecation warnings (``py.warnings.<library>``)
    and shows every other warning as before."""

    def __init__(self, show: Callable[..., None]):
        self.show = show
        self._folders: dict[str, Path] | None = None

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
        library = self.library_of(filename) if issubclass(category, (DeprecationWarning, FutureWarning)) else None
        if library is None:
            self.show(message, category, filename, lineno, file, line)
            return
        logging.getLogger(f"{WARNINGS_LOGGER}.{library}").warning(
            "%s:%d: %s: %s", filename, lineno, category.__name__, message)

    def library_of(self, filename: str) -> str | None:
        if self._folders is None:
            self._folders = {}
            for name in LIBRARIES:
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.submodule_search_locations:
                    self._folders[name] = Path(next(iter(spec.submodule_search_locations))).resolve()
        path = Path(filename).resolve()
        return next((name for name, folder in self._folders.items() if path.is_relative_to(folder)), None)


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once the module ``name`` is imported: now if it is, else right after the
    import that loads it (whoever imports it), through a finder first on ``sys.meta_path`` that
    wraps the module's loader and takes itself off once used."""
    if name in sys.modules:
        _call(then, sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def _call(then: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        then(module)
    except Exception as err:  # noqa: BLE001 - a library's changed API costs its quiet, never the run
        logging.getLogger(__name__).debug("could not route %s's output: %s", module.__name__, err)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this finder's work is done
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _call(self.then, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
