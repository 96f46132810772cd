"""The resolved run config as a tree, printed once at start (like the Lightning+Hydra template's
``print_config``): coloured on a terminal, plain when the output goes to a file (the run folder's
``.hydra/config.yaml`` keeps the same values).

Torch-free on purpose: the launcher prints it before any heavy import.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

from app.config import as_plain
from app.console.logs import in_parallel_job
from app.console.output import is_terminal, tree_shown_before

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
