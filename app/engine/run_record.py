"""What Hydra recorded of a run in its ``.hydra/`` folder, read back for the model card and the
trackers: the command line that reproduces the run, and its place in a sweep (the sweep folder and
the job's number). A run started without Hydra (``app.engine.run.run`` in-process) has no record.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.run_folder.layout import HYDRA_SETTINGS, hydra_file

NOT_REPRODUCING = ("resume", "overwrite", "mode")
"""Overrides that say how this run started, not what it trains: a reproduction starts afresh."""


@dataclass
class RunRecord:
    overrides: list[str] = field(default_factory=list)
    """The command line's overrides (Hydra's ``overrides.task``)."""
    sweep_dir: str | None = None
    """The sweep folder of a multirun's job; None for a single run."""
    job: int | None = None
    """The job's number in its sweep."""

    @property
    def command(self) -> str:
        """``python -m app <overrides>``, shell-quoted, without the ones that only say how it started."""
        kept = [o for o in self.overrides if o.split("=", 1)[0].lstrip("+~") not in NOT_REPRODUCING]
        return " ".join(["python -m app", *(shlex.quote(o) for o in kept)])


def read_run_record(run_dir: Path) -> RunRecord | None:
    """The record of ``.hydra/hydra.yaml``, or None when the run has none (or an unreadable one)."""
    import yaml  # type: ignore[import-untyped]

    try:
        hydra: Any = (yaml.safe_load(hydra_file(run_dir, HYDRA_SETTINGS).read_text(encoding="utf-8")) or {})["hydra"]
        overrides = [str(o) for o in (hydra.get("overrides") or {}).get("task") or []]
        multirun = str(hydra.get("mode")).endswith("MULTIRUN")
        job = (hydra.get("job") or {}).get("num")
        sweep = (hydra.get("sweep") or {}).get("dir")
        if sweep is not None and "${" in str(sweep):
            # Recorded unresolved (the default ``outputs/multirun/${now:...}``): the job's folder is
            # <sweep dir>/<subdir>, so the sweep folder is as many levels up as the subdir has parts.
            subdir = str((hydra.get("sweep") or {}).get("subdir") or "x")
            sweep = run_dir.parents[len(Path(subdir).parts) - 1]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    return RunRecord(overrides=overrides, sweep_dir=str(sweep) if multirun and sweep else None,
                     job=int(job) if multirun and job is not None else None)
