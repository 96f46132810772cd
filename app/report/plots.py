"""``sweep.png`` (each job's monitored metric against steps; the objective against each swept
parameter) and a single run's ``report.png`` (its loss and evaluation metrics against steps)."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Any

from app.report.collect import JobRow, best_row, read_events, swept_keys


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a cluster node
    import matplotlib.pyplot as plt

    return plt


def _as_number(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _short(value: str) -> str:
    """A swept value for a legend: numbers to 3 significant digits (Optuna's floats are long)."""
    number = _as_number(value)
    return value if number is None or value.lstrip("-").isdigit() else f"{number:.3g}"


def job_label(row: JobRow, keys: list[str]) -> str:
    """What tells the job apart: its swept values (``optim.lr=0.003``), else its number."""
    values = ", ".join(f"{key}={_short(row.params[key])}" for key in keys if key in row.params)
    return values or f"job {row.job}"


def log_scale(numbers: list[float]) -> bool:
    """Whether values read better on a log axis: all positive, spanning a factor of 10 or more, or
    spread evenly in their logarithm rather than linearly (``1e-3, 3e-3, 1e-2``)."""
    if not numbers or min(numbers) <= 0:
        return False
    distinct = sorted(set(numbers))
    if distinct[-1] / distinct[0] >= 10:
        return True
    if len(distinct) < 3 or distinct[-1] / distinct[0] < 3:
        return False

    def unevenness(points: list[float]) -> float:
        gaps = [b - a for a, b in itertools.pairwise(points)]
        return max(gaps) / min(gaps)

    return unevenness([math.log(n) for n in distinct]) < unevenness(distinct)


def axis_scale(key: str, rows: list[JobRow], numbers: list[float]) -> tuple[str, bool]:
    """How a swept parameter's axis is drawn: ``log`` or ``linear``, and whether its values are a few
    picked ones (a grid's, ``choice``, ``range``) rather than drawn from an interval. An Optuna search
    space says both (``tag(log, interval(...))``: log, drawn); a grid's values are picked, on a log
    axis when they are spread that way (:func:`log_scale`)."""
    spec = next((row.search_space[key] for row in rows if key in row.search_space), None)
    if spec is not None:
        log = bool(re.search(r"\btag\(\s*log\b", spec)) and min(numbers, default=0) > 0
        return ("log" if log else "linear"), "interval(" not in spec
    return ("log" if log_scale(numbers) else "linear"), True


FEW_VALUES = 6
"""Picked values (a grid, a choice) this many or fewer are ticked at the values themselves."""


def _ticks(ax: Any, numbers: list[float], scale: str, picked: bool) -> None:
    """Tick labels that never overlap: at the values themselves when a few were picked; on a log axis,
    at 1, 2 and 5 times the powers of ten, written plainly (``0.002``), without minor labels."""
    from matplotlib import ticker

    ax.set_xscale(scale)
    distinct = sorted(set(numbers))
    if picked and len(distinct) <= FEW_VALUES:
        ax.xaxis.set_major_locator(ticker.FixedLocator(distinct))
    elif scale == "log":
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        return
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:.3g}"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())


LEGEND_CHAR_PX = 4.6
"""About how wide one character of a 7-point legend is at the figure's 80 dpi."""


def plot_sweep(rows: list[JobRow], path: Path) -> None:
    plt = _pyplot()
    fig = sweep_figure(rows)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def sweep_figure(rows: list[JobRow]) -> Any:
    """The monitored metric per job (labelled by its swept values, the legend under the panels, where
    it covers no curve) and the objective against each swept parameter (a log axis where the search
    space, or the values' spread, says so)."""
    plt = _pyplot()
    keys = swept_keys(rows)
    best = best_row(rows)
    monitor = rows[0].monitor if rows else "metric"
    panels = 1 + len(keys)
    columns = min(3, panels)
    grid_rows = math.ceil(panels / columns)
    fig = plt.figure(figsize=(5.2 * columns, 3.9 * grid_rows), layout="constrained")
    grid = fig.subplots(grid_rows, columns, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for unused in axes[panels:]:
        unused.set_visible(False)
    curves = axes[0]
    for row in rows:
        if not row.curve:
            continue
        steps, metric = zip(*row.curve)
        is_best = row is best
        curves.plot(steps, metric, marker=".", linewidth=2.6 if is_best else 1.0, alpha=1.0 if is_best else 0.7,
                    label=job_label(row, keys) + (" (best)" if is_best else "") + ("" if row.status == "finished"
                                                                                   else f" [{row.status}]"))
    _mark_pruned(curves, rows)
    curves.set_xlabel("optimizer step")
    curves.set_ylabel(monitor)
    curves.set_title(f"{monitor} per job")
    curves.grid(alpha=0.3)
    handles, labels = curves.get_legend_handles_labels()
    if labels and len(rows) <= 12:
        width_px = fig.get_figwidth() * 80
        fits = int(width_px // (max(map(len, labels)) * LEGEND_CHAR_PX + 40))
        fig.legend(handles, labels, loc="outside lower center", ncols=max(1, min(fits, len(labels))), fontsize=7,
                   title=f"jobs ({monitor} per job)", title_fontsize=8, frameon=False)

    finished = [r for r in rows if r.objective() is not None]
    left_out = ", ".join(f"{sum(r.status == status for r in rows if r not in finished)} {status}"
                         for status in dict.fromkeys(r.status for r in rows if r not in finished))
    for ax, key in zip(axes[1:], keys):
        values = [r.params.get(key, "") for r in finished]
        numbers = [_as_number(v) for v in values]
        objectives = [r.objective() for r in finished]
        if all(n is not None for n in numbers):
            xs: list[Any] = numbers
            _ticks(ax, xs, *axis_scale(key, rows, xs))
        else:  # categories: one position each, labelled
            labels = sorted(set(values))
            xs = [labels.index(v) for v in values]
            ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
        ax.scatter(xs, objectives, s=30, color="tab:blue")
        for row, x, y in zip(finished, xs, objectives):
            if row is best:
                ax.scatter([x], [y], s=160, marker="*", color="tab:red", zorder=3, label=f"best (job {row.job})")
            ax.annotate(str(row.job), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel(key)
        ax.set_ylabel(f"best {monitor}")
        ax.set_title(f"objective vs {key}" + (f"\n({left_out} not shown)" if left_out else ""), fontsize=9)
        ax.grid(alpha=0.3)
        if best is not None:
            ax.legend(fontsize=7)
    return fig


def _mark_pruned(ax: Any, rows: list[JobRow]) -> None:
    """A black x where a pruned sweep's pruner stopped a job (its last evaluation)."""
    stops = [row.curve[-1] for row in rows if row.pruned_step is not None and row.curve]
    if stops:
        ax.scatter(*zip(*stops), marker="x", s=60, color="black", zorder=4, label=f"pruned ({len(stops)})")


def plot_run(folder: Path, path: Path) -> None:
    """train/loss and every evaluation metric of one run folder against steps (:func:`run_figure`)."""
    plt = _pyplot()
    fig = run_figure(folder)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run_figure(folder: Path) -> Any:
    """The loss (training and evaluation), then the evaluation metrics, one panel per scale
    (:func:`metric_panels`): DPO's log-probabilities (about -30) never squash its accuracies (0 to 1)."""
    plt = _pyplot()
    events = read_events(folder)
    names = sorted({k for e in events for k in e if k.startswith("eval/") and k not in ("eval/num_samples", "eval/loss")})
    series = {name: [(e["step"], float(e[name])) for e in events if name in e] for name in names}
    panels = metric_panels({name: [value for _, value in points] for name, points in series.items()})
    columns = min(3, 1 + len(panels))
    grid_rows = math.ceil((1 + len(panels)) / columns)
    fig = plt.figure(figsize=(5.2 * columns, 4.0 * grid_rows), layout="constrained")
    axes = [ax for row in fig.subplots(grid_rows, columns, squeeze=False) for ax in row]
    for unused in axes[1 + len(panels):]:
        unused.set_visible(False)
    loss = [(e["step"], float(e["train/loss"])) for e in events if "train/loss" in e]
    if loss:
        axes[0].plot(*zip(*loss), label="train/loss")
    eval_loss = [(e["step"], float(e["eval/loss"])) for e in events if "eval/loss" in e]
    if eval_loss:
        axes[0].plot(*zip(*eval_loss), marker=".", label="eval/loss")
    axes[0].set_title("loss")
    for ax, (title, members) in zip(axes[1:], panels.items()):
        for name in members:
            ax.plot(*zip(*series[name]), marker=".", label=name)
        ax.set_title(title)
    for ax in axes[:1 + len(panels)]:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8)
    fig.suptitle(str(folder), fontsize=9)
    return fig


SCALE_RATIO = 10.0
"""Metrics whose largest magnitudes differ by this factor or more are drawn in panels of their own."""


def metric_panels(values: dict[str, list[float]]) -> dict[str, list[str]]:
    """The evaluation metrics grouped into panels that share a scale, each titled: by family
    (``eval/rewards/...``, ``eval/logps/...``, the rest of ``eval/``), a family split where the largest
    magnitudes differ tenfold (values within [-1, 1] count as 1: accuracies beside rewards, perplexity
    apart from token accuracy)."""
    families: dict[str, list[str]] = {}
    for name in values:
        families.setdefault(name.rpartition("/")[0], []).append(name)
    panels: dict[str, list[str]] = {}
    for family, names in families.items():
        size = {name: max([1.0, *(abs(v) for v in values[name] if math.isfinite(v))]) for name in names}
        groups: list[list[str]] = []
        for name in sorted(names, key=lambda n: (size[n], n)):
            if groups and size[name] < SCALE_RATIO * size[groups[-1][0]]:
                groups[-1].append(name)
            else:
                groups.append([name])
        for group in groups:
            title = group[0] if len(group) == 1 else "evaluation metrics" if family == "eval" else f"{family}/…"
            panels[title] = sorted(group)
    return panels
