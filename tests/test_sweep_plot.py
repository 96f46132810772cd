"""``sweep.png``: each job's curve is labelled by its swept values (not its number), and log-spaced
values sit on a log axis (``-m optim.lr=1e-3,3e-3,1e-2``); an Optuna search's axes follow its search
space; the legends cover no curve and stay inside the image, and no two tick labels overlap. A run's
``report.png`` draws each scale in a panel of its own (DPO's log-probabilities apart from its accuracies)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from app.report.collect import JobRow, best_row, not_comparable
from app.report.plots import log_scale, metric_panels, plot_sweep, run_figure, sweep_figure


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
    objective = fig.axes[1]
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == ["optim.lr=0.001, task.dropout=0.123", "optim.lr=0.003 (best)", "optim.lr=0.01"], labels
    assert objective.get_xlabel() == "optim.lr" and objective.get_xscale() == "log"
    assert [label.get_text() for label in objective.get_xticklabels()] == ["0.001", "0.003", "0.01"]  # the grid's values
    plot_sweep(grid_rows(tmp_path), tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_axis_only_for_values_spread_that_way():
    assert log_scale([1e-3, 3e-3, 1e-2]) and log_scale([1e-4, 1e-3]) and log_scale([0.001, 0.002, 0.004, 0.008])
    assert not log_scale([16, 32, 48, 64]) and not log_scale([0.1, 0.2]) and not log_scale([0.0, 0.1, 0.4])


# conf/hparams_search/digits_optuna.yaml's space, as each job's .hydra/hydra.yaml records it.
DIGITS_SPACE = {"optim.lr": "tag(log, interval(3e-4, 3e-2))", "optim.weight_decay": "interval(0.0, 0.1)",
                "task.dropout": "interval(0.0, 0.4)", "trainer.batch_size": "choice(16, 32, 64)"}


def optuna_rows(tmp_path: Path) -> list[JobRow]:
    """Ten trials of that search, four of them pruned, with Optuna's long floats."""
    rng = random.Random(0)
    rows = []
    for job in range(10):
        params = {"optim.lr": 10 ** rng.uniform(-3.5, -1.5), "optim.weight_decay": rng.uniform(0, 0.1),
                  "task.dropout": rng.uniform(0, 0.4), "trainer.batch_size": rng.choice([16, 32, 64])}
        pruned = job >= 6
        curve = [(23 * i, 0.7 + 0.02 * i + 0.01 * rng.random()) for i in range(1, 4 if pruned else 9)]
        rows.append(JobRow(folder=tmp_path / str(job), job=job, overrides=[f"{k}={v}" for k, v in params.items()],
                           status="pruned" if pruned else "finished", monitor="eval/accuracy", mode="max",
                           best=max(v for _, v in curve), best_step=curve[-1][0], steps=curve[-1][0],
                           wall_time_s=1.0, curve=curve, search_space=dict(DIGITS_SPACE)))
    return rows


def test_an_optuna_search_keeps_its_legends_off_the_curves_and_no_tick_labels_overlap(tmp_path):
    rows = optuna_rows(tmp_path)
    fig = sweep_figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    _curves, *objectives = [ax for ax in fig.axes if ax.get_visible()]
    # The curves' legend: every job and the pruned marker, under the panels, whole inside the image.
    legend = fig.legends[0].get_window_extent(renderer)
    assert len(fig.legends[0].get_texts()) == 11
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 and fig.bbox.y0 <= legend.y0
    assert all(not legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes if ax.get_visible())
    # Each axis as the search space says; tick labels apart, each inside the image.
    assert [(ax.get_xlabel(), ax.get_xscale()) for ax in objectives] == [
        ("optim.lr", "log"), ("optim.weight_decay", "linear"), ("task.dropout", "linear"),
        ("trainer.batch_size", "linear")]
    chosen = sorted({int(r.params["trainer.batch_size"]) for r in rows if r.status == "finished"})
    assert [t.get_text() for t in objectives[3].get_xticklabels()] == [str(v) for v in chosen]  # a choice: its values
    best = best_row(rows)
    for ax in objectives:
        low, high = sorted(ax.get_xlim())
        labels = [t for t in ax.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high]  # drawn
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert len(boxes) >= 2, ax.get_xlabel()
        assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
            (ax.get_xlabel(), [t.get_text() for t in labels])
        assert all(fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 for box in boxes)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"best (job {best.job})"]


def test_a_dpo_runs_report_draws_each_scale_in_its_own_panel(tmp_path):
    """Log-probabilities (about -68) and accuracies (0 to 1) never share an axis; rewards and accuracies,
    on one scale, do; perplexity is apart from token accuracy."""
    rows = [{"step": step, "train/loss": 0.69 - step / 100} for step in (10, 20)]
    for step, accuracy in ((5, 0.7), (10, 0.875), (20, 0.96)):
        rows.append({"step": step, "eval/loss": 0.69 - step / 100, "eval/rewards/chosen": step / 200,
                     "eval/rewards/rejected": -step / 300, "eval/rewards/margins": step / 120,
                     "eval/rewards/accuracies": accuracy, "eval/logps/chosen": -68 + step / 50,
                     "eval/logps/rejected": -68 - step / 40, "eval/num_samples": 24})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    fig = run_figure(tmp_path)
    drawn = {ax.get_title(): sorted(line.get_label() for line in ax.get_lines()) for ax in fig.axes if ax.get_visible()}
    assert drawn == {"loss": ["eval/loss", "train/loss"],
                     "eval/logps/…": ["eval/logps/chosen", "eval/logps/rejected"],
                     "eval/rewards/…": ["eval/rewards/accuracies", "eval/rewards/chosen", "eval/rewards/margins",
                                        "eval/rewards/rejected"]}, drawn
    assert metric_panels({"eval/perplexity": [585.1, 40.2], "eval/token_accuracy": [0.0, 0.31]}) == {
        "eval/token_accuracy": ["eval/token_accuracy"], "eval/perplexity": ["eval/perplexity"]}
    assert metric_panels({"eval/accuracy": [0.9], "eval/f1": [0.8], "eval/rewards/margins": [12.0],
                          "eval/rewards/accuracies": [1.0]}) == {
        "evaluation metrics": ["eval/accuracy", "eval/f1"], "eval/rewards/accuracies": ["eval/rewards/accuracies"],
        "eval/rewards/margins": ["eval/rewards/margins"]}


def test_a_sweep_says_when_its_objective_does_not_compare_across_what_it_sweeps(tmp_path):
    """task=dpo's eval/loss across task.beta (or task.loss_type...) names no best model; its
    eval/rewards/accuracies does; a key that does not scale the monitor (optim.lr) is no reason."""
    def dpo_rows(key: str, values: tuple[str, ...], monitor: str = "eval/loss") -> list[JobRow]:
        return [JobRow(folder=tmp_path / str(job), job=job, overrides=[f"{key}={value}"], status="finished",
                       monitor=monitor, mode="min", best=0.5 + job / 10, best_step=4, steps=4, wall_time_s=1.0,
                       task="dpo") for job, value in enumerate(values)]

    assert not_comparable(dpo_rows("task.beta", ("0.1", "0.5"))) == (
        "eval/loss does not compare across task.beta (its value changes eval/loss's scale), so the best by it is "
        "not the best model; rank by one that does: early_stopping.monitor=eval/rewards/accuracies (docs/dpo.md).")
    assert "across task.loss_type" in not_comparable(dpo_rows("task.loss_type", ("sigmoid", "ipo")))
    assert not_comparable(dpo_rows("task.beta", ("0.1", "0.5"), monitor="eval/rewards/accuracies")) is None
    assert not_comparable(dpo_rows("optim.lr", ("1e-6", "1e-5"))) is None
    assert not_comparable(grid_rows(tmp_path)) is None  # digits: nothing scales its accuracy
