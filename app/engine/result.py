"""``<run folder>/result.json``: how a run ended, written last by the main process.

A sweep's report reads it to tell the jobs apart (finished, ended on a non-finite loss, failed);
a folder without it was interrupted (killed, preempted) or never started. A resumed sweep reads the
objective of a finished job back from it instead of training the job again.

Its fields (``app.engine.run``): ``status`` (below); ``monitor`` and ``mode`` (early_stopping's);
``best``, the best value of the monitored metric, and ``best_step``, the optimizer step of the
evaluation that first reached it; ``objective`` (:func:`objective`); ``steps``, the optimizer steps
trained when the run ended (over all of a resumed run's segments); ``stop_reason``, the sentence the log
ends training with; ``exported``, what ``model/`` holds (None: nothing exported): ``weights`` (best,
last, or last (best not saved)), the ``checkpoint`` holding them (None: none does), their ``step`` and
their evaluation's ``metrics``; ``wall_time_s`` of this segment; ``error`` when it failed or diverged.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from app.run_folder.layout import RESULT_FILE, result_file

FINISHED = "finished"
"""Training ended normally (steps, epochs or early stopping); ``best`` is the objective."""
PRUNED = "pruned"
"""Stopped by a pruned sweep (``hydra.sweeper.pruner``) as clearly worse than its other trials: an early
stop that exported its best, told to the study as pruned, never the sweep's best."""
NAN = "nan"
"""Stopped because the training loss was not finite: reported to a search as a failed trial."""
FAILED = "failed"
"""An exception ended the run."""
INTERRUPTED = "interrupted"
"""Stopped from outside (a signal, Ctrl-C); also what a folder without result.json means."""


def write_result(run_dir: Path, **fields: Any) -> None:
    """Write result.json atomically (a killed writer leaves the old file or none, never half of one)."""
    # JSON has no NaN: a value that is not finite is written as null.
    plain = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
    temporary = run_dir / f".{RESULT_FILE}.tmp"
    temporary.write_text(json.dumps(plain, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(temporary, result_file(run_dir))


def read_result(run_dir: Path) -> dict[str, Any] | None:
    """result.json as a dict, or None when the run left none (or an unreadable one)."""
    try:
        loaded = json.loads(result_file(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def objective(best: float | None, status: str) -> float:
    """What a sweeper optimises: the best monitored value of a finished run, NaN otherwise (Optuna
    records a NaN as a failed trial, never as a winning number)."""
    if status != FINISHED or best is None or not math.isfinite(best):
        return math.nan
    return float(best)
