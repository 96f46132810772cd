"""The resolved run config at start: on the terminal, one line with the command line's overrides and
where the whole config is (the run folder's ``.hydra/config.yaml``, and the tree in its ``app.log``);
with ``logging.print_config=true``, the whole config as a tree (like the Lightning+Hydra template's
``print_config``), coloured on a terminal, plain when the output goes to a file.

Torch-free on purpose: the launcher prints it before any heavy import.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from app.config import as_plain
from app.console.logs import in_parallel_job
from app.console.output import in_sweep_job, is_terminal, tree_shown_before

_GROUP, _KEY, _RESET = "\033[1;36m", "\033[33m", "\033[0m"


def config_tree(cfg: Any, colour: bool = False) -> str:
    """``cfg`` as an indented tree: groups first, top-level values last."""
    values = as_plain(cfg)
    groups = [(k, v) for k, v in values.items() if isinstance(v, dict)]
    leaves = [(k, v) for k, v in values.items() if not isinstance(v, dict)]
    group, key, reset = (_GROUP, _KEY, _RESET) if colour else ("", "", "")
    lines = ["config"]
    items = groups + leaves
    for i, (name, value) in enumerate(items):
        last = i == len(items) - 1
        branch, stem = ("└── ", "    ") if last else ("├── ", "│   ")
        if isinstance(value, dict):
            lines.append(f"{branch}{group}{name}{reset}")
            for j, (k, v) in enumerate(value.items()):
                twig = "└── " if j == len(value) - 1 else "├── "
                lines.append(f"{stem}{twig}{key}{k}{reset}: {scalar_text(v)}")
        else:
            lines.append(f"{branch}{key}{name}{reset}: {scalar_text(value)}")
    return "\n".join(lines)


def scalar_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {scalar_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(scalar_text(v) for v in value) + "]"
    return str(value)


def show_config(cfg: Any, stream: TextIO | None = None) -> None:
    """Print the tree, coloured only when ``stream`` is a terminal. In a job of a parallel sweep it
    goes to the job's log instead (the jobs share the terminal), and so does a sweep job's after the
    first one this process ran (at DEBUG: the log file only; Hydra's launcher line says its overrides)."""
    if stream is None and in_parallel_job():
        logging.getLogger("app").info("%s", config_tree(cfg))
        return
    if stream is None and tree_shown_before():
        logging.getLogger("app").debug("%s", config_tree(cfg))
        return
    stream = stream or sys.stdout
    print(config_tree(cfg, colour=is_terminal(stream)), file=stream, flush=True)


def introduce_config(cfg: Any, overrides: Sequence[str]) -> None:
    """The config at start: the tree (``logging.print_config=true``: :func:`show_config`), or the tree in
    the log file only and, on the terminal, one line saying the overrides and where the rest is (a sweep's
    job says nothing more: Hydra's launcher line gives its overrides)."""
    if cfg.logging.print_config:
        show_config(cfg)
        return
    log = logging.getLogger("app")
    log.debug("%s", config_tree(cfg))  # app.log only (app.console.logs.details_to_log_file)
    if in_sweep_job():
        return
    given = f" with {' '.join(overrides)}" if overrides else ""
    log.info("config: the defaults%s (the whole config: .hydra/config.yaml and app.log in the run folder; "
             "logging.print_config=true prints it here)", given)
