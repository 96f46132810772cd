"""TensorBoard's HParams tab for a sweep: one session per job under ``<sweep>/hparams/<job>``, with
the swept values as hyperparameters and the objective and final metrics as its metrics.
``tensorboard --logdir <sweep folder>`` then shows the jobs side by side (and each job's own curves,
from ``<job>/tensorboard``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from app.report.collect import JobRow, swept_keys

HPARAMS_DIR = "hparams"


def _value(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def write_hparams(rows: list[JobRow], sweep_dir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    root = sweep_dir / HPARAMS_DIR
    shutil.rmtree(root, ignore_errors=True)  # a rebuilt report replaces the sessions, not adds to them
    keys = swept_keys(rows)
    for row in rows:
        hparams: dict[str, float | str] = {k: _value(row.params.get(k, "")) for k in keys}
        hparams["status"] = row.status
        metrics = {f"final/{k}": v for k, v in row.final.items()}
        metrics[f"best/{row.monitor}"] = row.best if row.best is not None else float("nan")
        with SummaryWriter(log_dir=str(root / str(row.job))) as writer:
            writer.add_hparams(hparams, metrics, run_name=".")
