"""Sweep and run reports: ``python -m app.report <sweep folder | run folder>``, and the Hydra callback
that writes a sweep's report at the end of every multirun.

A sweep folder gets ``sweep.csv`` (one row per job), ``sweep.md`` (ranked by the objective, the best
job marked), ``sweep.png`` and, when the jobs logged to TensorBoard, ``hparams/`` for its HParams tab.
A run folder gets ``report.png`` (its loss and metrics against steps).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from app.run_folder.layout import REPORT_FILE, metrics_file, result_file, tensorboard_dir

log = logging.getLogger(__name__)

SWEEP_CSV, SWEEP_MD, SWEEP_PNG, RUN_PNG = "sweep.csv", "sweep.md", "sweep.png", REPORT_FILE


class NotAReportFolder(ValueError):
    """The folder holds neither a run nor a sweep's jobs."""


def is_run_folder(folder: Path) -> bool:
    return metrics_file(folder).exists() or result_file(folder).exists()


def write_sweep_report(sweep_dir: Path) -> list[Path]:
    """Write the sweep's report files; returns their paths."""
    from app.report.collect import read_sweep
    from app.report.plots import plot_sweep
    from app.report.tables import write_csv, write_markdown

    rows = read_sweep(sweep_dir)
    if not rows:
        raise NotAReportFolder(f"{sweep_dir} has no job folders (no */.hydra/overrides.yaml); "
                               "pass a sweep folder or a run folder.")
    written = [sweep_dir / SWEEP_CSV, sweep_dir / SWEEP_MD, sweep_dir / SWEEP_PNG]
    write_csv(rows, written[0], sweep_dir)
    write_markdown(rows, written[1], sweep_dir)
    plot_sweep(rows, written[2])
    if any(tensorboard_dir(row.folder).is_dir() for row in rows):
        from app.report.hparams import HPARAMS_DIR, write_hparams

        write_hparams(rows, sweep_dir)
        written.append(sweep_dir / HPARAMS_DIR)
    return written


def write_report(folder: Path) -> list[Path]:
    """A run folder's ``report.png``, or a sweep folder's report."""
    if not folder.is_dir():
        raise NotAReportFolder(f"{folder} is not a folder.")
    if is_run_folder(folder):
        from app.report.plots import plot_run

        plot_run(folder, folder / RUN_PNG)
        return [folder / RUN_PNG]
    return write_sweep_report(folder)


class SweepReport(Callback):
    """``hydra.callbacks``: at the end of every multirun, the sweep folder's report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            written = write_sweep_report(sweep_dir)
        except NotAReportFolder as err:  # no job got as far as its folder: nothing to report
            log.warning("no sweep report: %s", err)
            return
        log.info("sweep report: %s", ", ".join(str(p) for p in written))
        from app.report.collect import not_comparable, read_sweep

        if (caveat := not_comparable(read_sweep(sweep_dir))) is not None:
            log.warning("the sweep's objective: %s", caveat)
