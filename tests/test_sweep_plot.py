"""``sweep.png``: each job's curve is labelled by its swept values (not its number), and log-spaced
values sit on a log axis (``-m optim.lr=1e-3,3e-3,1e-2``)."""

from __future__ import annotations

from pathlib import Path

from app.report.collect import JobRow
from app.report.plots import log_scale, plot_sweep, sweep_figure


def grid_rows(tmp_path: Path) -> list[JobRow]:
    """What a finished grid sweep over three log-spaced learning rates reads back."""
    rows = []
    for job, (lr, best) in enumerate([("1e-3", 0.95), ("3e-3", 0.97), ("1e-2", 0.96)]):
        curve = [(45, best - 0.02), (90, best)]
        rows.append(JobRow(folder=tmp_path / str(job), job=job, overrides=[f"optim.lr={lr}", "trainer.max_epochs=2"],
                           status="finished", monitor="eval/accuracy", mode="max", best=best, best_step=90, steps=90,
                           wall_time_s=3.0, curve=curve))
    rows[0].overrides.append("task.dropout=0.12345678")  # an Optuna-like long float, also swept
    return rows


def test_sweep_plot_labels_jobs_by_their_values_on_a_log_axis(tmp_path):
    fig = sweep_figure(grid_rows(tmp_path))
    curves, objective = fig.axes[0], fig.axes[1]
    labels = [text.get_text() for text in curves.get_legend().get_texts()]
    assert labels == ["optim.lr=0.001, task.dropout=0.123", "optim.lr=0.003 (best)", "optim.lr=0.01"], labels
    assert objective.get_xlabel() == "optim.lr" and objective.get_xscale() == "log"
    plot_sweep(grid_rows(tmp_path), tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_axis_only_for_values_spread_that_way():
    assert log_scale([1e-3, 3e-3, 1e-2]) and log_scale([1e-4, 1e-3]) and log_scale([0.001, 0.002, 0.004, 0.008])
    assert not log_scale([16, 32, 48, 64]) and not log_scale([0.1, 0.2]) and not log_scale([0.0, 0.1, 0.4])
