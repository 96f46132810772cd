"""Other libraries' chatter, kept off the terminal: what they say goes to the run's ``app.log``, in
plain text, and only their errors reach the terminal. Torch-free, and nothing here imports the
libraries: each is routed when (if ever) it is imported.

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

import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

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
