"""Accelerate's ``accelerate.logging``: a logger whose calls know about the processes.

>>> from app.distributed import Accelerator
>>> from app.distributed.logging import get_logger
>>> logger = get_logger(__name__)
>>> accelerator = Accelerator()
>>> logger.info("once, on the main process")
>>> logger.info("on every process", main_process_only=False)
>>> logger.info(f"rank {accelerator.process_index}", in_order=True)   # rank 0's line, then rank 1's...

Messages are prefixed ``[RANK i]`` and reported from the caller's line, as Accelerate 1.15 does.
Like Accelerate's, a call before any ``Accelerator()`` or ``PartialState()`` raises RuntimeError: the
logger must know which process it runs on. One difference on purpose: with ``in_order=True`` every
process joins the barriers even where its logger's level leaves the message out (Accelerate's skips
them there, and the processes that log wait for it forever).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from app.distributed.backends.base import Backend
from app.distributed.state import current_backend

LOG_LEVEL_VARIABLE = "ACCELERATE_LOG_LEVEL"
"""Accelerate's variable: the level ``get_logger`` sets when it is not given one."""


class MultiProcessAdapter(logging.LoggerAdapter[logging.Logger]):
    """A ``logging.LoggerAdapter`` whose calls take ``main_process_only`` (default True: only the main
    process logs) and ``in_order`` (default False; True: every process logs, one after the other, in
    rank order — it waits for the others, so every process must make the call)."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        msg, kwargs = super().process(msg, kwargs)
        # The record names the caller's file and line, not this module's.
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {_backend().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        backend = _backend()
        enabled = self.isEnabledFor(level)
        options: MutableMapping[str, Any] = kwargs
        if enabled:
            msg, options = self.process(msg, kwargs)
        if in_order:  # main_process_only is ignored, as in Accelerate
            for rank in range(backend.num_processes):
                if enabled and rank == backend.process_index:
                    self.logger.log(level, msg, *args, **options)
                backend.barrier()
        elif enabled and (not main_process_only or backend.process_index == 0):
            self.logger.log(level, msg, *args, **options)

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning()``, once per distinct arguments for this logger (Accelerate's name)."""
        key = (args, tuple(sorted(kwargs.items())))
        warned: set[Any] = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            self.warning(*args, **{"stacklevel": 3, **kwargs})  # the record names our caller's line


def _backend() -> Backend:
    backend = current_backend()
    if backend is None:
        raise RuntimeError("You must initialize the accelerate state by calling either `PartialState()` or "
                           "`Accelerator()` before using the logging utility.")
    return backend


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` (``logging.getLogger``), wrapped so that its calls take
    ``main_process_only`` and ``in_order``. ``log_level`` (default: the ``ACCELERATE_LOG_LEVEL``
    variable, if set) is set on that logger and on the root logger, as Accelerate does.

    >>> logger = get_logger(__name__, log_level="DEBUG")
    """
    if log_level is None:
        log_level = os.environ.get(LOG_LEVEL_VARIABLE)
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


__all__ = ["MultiProcessAdapter", "get_logger"]
