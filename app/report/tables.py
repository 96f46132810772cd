"""``sweep.csv`` (every job, in job order) and ``sweep.md`` (ranked by the objective, best marked; a
sweep over several tasks, such as ``task=glue_cola,glue_rte,...``, gets one table of the tasks instead,
with each task's metrics and, for GLUE, the GLUE score)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from app.report.collect import JobRow, best_row, not_comparable, ranked, swept_keys


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _short(value: str) -> str:
    """A swept value as a table shows it: 0.0013867767003062484 -> 0.001387."""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if number.is_integer() or len(value) <= 8 else f"{number:.4g}"


def _exported(row: JobRow) -> str:
    """What a job's ``model/`` holds, as a cell: ``best (step 15)``, ``last (step 30)``; empty: nothing."""
    exported = row.exported or {}
    return f"{exported['weights']} (step {exported['step']})" if "weights" in exported and "step" in exported else ""


def _status(row: JobRow) -> str:
    """A job's state as the table shows it: a pruned one with the step it stopped at."""
    return row.status if row.pruned_step is None else f"{row.status} at step {row.pruned_step}"


def write_csv(rows: list[JobRow], path: Path, sweep_dir: Path) -> None:
    """One row per job: job number, overrides, status (finished, pruned, nan, failed, interrupted),
    best monitored value and its step, steps, the step a pruned job was stopped at, wall time, final
    metrics (``final/<name>``), run folder (relative to the sweep folder)."""
    metric_names = sorted({name for row in rows for name in row.final})
    header = ["job", "task", "overrides", "status", "monitor", "best", "best_step", "steps", "pruned_at_step",
              "wall_time_s",
              *(f"final/{name}" for name in metric_names), "folder"]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            writer.writerow([
                row.job, row.task or "", " ".join(row.overrides), row.status, row.monitor,
                "" if row.best is None else repr(row.best), row.best_step, row.steps, row.pruned_step, row.wall_time_s,
                *(row.final.get(name, "") for name in metric_names), row.folder.relative_to(sweep_dir),
            ])


TASK_METRICS_LEFT_OUT = ("loss", "num_samples")
"""Evaluation keys that are no task's score (also with an evaluation set's suffix: ``loss_mm``)."""


def task_scores(row: JobRow) -> dict[str, float]:
    """A job's task metrics at its best evaluation, without the prefix, loss and sample counts."""
    return {key.removeprefix("eval/"): value for key, value in row.at_best.items() if key.startswith("eval/")
            and not any(key.removeprefix("eval/").startswith(left) for left in TASK_METRICS_LEFT_OUT)}


def tasks_markdown(rows: list[JobRow], sweep_dir: Path) -> str:
    """One row per job of a sweep over tasks: its metrics at its best evaluation and its score (their
    mean, x100, as GLUE's leaderboard shows it); the GLUE score (the mean of the tasks' scores) when
    every task is a GLUE one and finished."""
    glue = all((row.task or "").startswith("glue_") for row in rows)
    title = "GLUE summary" if glue else "Tasks"
    lines = [f"# {title}: sweep {sweep_dir}", "",
             (f"{len(rows)} job(s), one task each; each task's metrics at its best `early_stopping.monitor` "
             "(what checkpoint.export=best exports). Score: their mean x 100."), "",
             "| task | metrics | score | monitor | status | steps | folder |", "|---|---|---|---|---|---|---|"]
    scores = []
    for row in rows:
        metrics = task_scores(row)
        score = 100 * sum(metrics.values()) / len(metrics) if metrics and row.status == "finished" else None
        if score is not None and math.isfinite(score):
            scores.append(score)
        cells = [row.task or "?", ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()), _fmt_score(score),
                 f"{row.monitor} (best {_fmt(row.best)})", row.status, _fmt(row.steps),
                 str(row.folder.relative_to(sweep_dir))]
        lines.append("| " + " | ".join(cells) + " |")
    if glue:
        complete = len(scores) == len(rows)
        average = f"{sum(scores) / len(scores):.1f}" if complete and scores else "n/a (a task has no finished score)"
        lines += ["", f"**GLUE score** over the {len(rows)} task(s) run: {average}."]
    return "\n".join(lines) + "\n"


def _fmt_score(score: float | None) -> str:
    return "" if score is None or not math.isfinite(score) else f"{score:.1f}"


def markdown(rows: list[JobRow], sweep_dir: Path) -> str:
    """The jobs as a Markdown table, best first, the best finished job marked and named above it; jobs
    of different tasks as one table of tasks (their objectives do not compare)."""
    if len({row.task for row in rows}) > 1:
        return tasks_markdown(rows, sweep_dir)
    keys = swept_keys(rows)
    best = best_row(rows)
    monitor = rows[0].monitor if rows else "?"
    mode = rows[0].mode if rows else "max"
    direction = "higher" if mode == "max" else "lower"
    counts = ", ".join(f"{sum(r.status == status for r in rows)} {status}"
                       for status in dict.fromkeys(r.status for r in rows))
    lines = [f"# Sweep {sweep_dir}", "",
             (f"{len(rows)} job(s) ({counts}); objective: best `{monitor}` ({direction} is better, "
              f"early_stopping.mode={mode}).")]
    if (caveat := not_comparable(rows)) is not None:
        lines.append(f"**Not comparable:** {caveat}")
    if best is not None:
        params = ", ".join(f"{k}={_short(best.params.get(k, ''))}" for k in keys) or " ".join(best.overrides)
        lines.append(f"**Best: job {best.job}** ({params}): {monitor} = {best.best!r} at step {best.best_step}."
                     + _holds(best))
    else:
        lines.append("**No job finished with a finite objective.**")
    lines += ["", "| rank | job | " + " | ".join(keys + ["status", f"best {monitor}", "best step", "steps",
                                                        "exported", "wall s", "folder"]) + " |",
              "|" + "---|" * (len(keys) + 9)]
    for rank, row in enumerate(ranked(rows), start=1):
        mark = " ★" if row is best else ""
        cells = [f"{rank}{mark}", str(row.job), *(_short(row.params.get(k, "")) for k in keys), _status(row),
                 _fmt(row.best), _fmt(row.best_step), _fmt(row.steps), _exported(row), _fmt(row.wall_time_s, 3),
                 str(row.folder.relative_to(sweep_dir))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _holds(row: JobRow) -> str:
    """What the best job's ``model/`` holds, said after its best value: that evaluation's weights (where
    they were kept), or which others."""
    exported = row.exported or {}
    if "weights" not in exported:
        return ""
    where = f" (`checkpoints/{exported['checkpoint']}`)" if exported.get("checkpoint") else ""
    if exported["weights"] == "best" and exported.get("step") == row.best_step:
        return f" Its `model/` holds the weights of that evaluation{where}."
    return f" Its `model/` holds the {exported['weights']} weights, of step {exported.get('step')}{where}."


def write_markdown(rows: list[JobRow], path: Path, sweep_dir: Path) -> None:
    path.write_text(markdown(rows, sweep_dir), encoding="utf-8")
