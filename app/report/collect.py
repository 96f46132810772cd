"""Read what a sweep's jobs left on disk: each job folder's ``.hydra/``, ``metrics.jsonl`` and
``result.json`` become one :class:`JobRow`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.engine.result import FINISHED, INTERRUPTED, PRUNED, read_result
from app.run_folder.layout import (
    CHECKPOINTS_DIR,
    HYDRA_CONFIG,
    HYDRA_DIR,
    HYDRA_OVERRIDES,
    HYDRA_SETTINGS,
    hydra_file,
    metrics_file,
)
from app.tasks import TASK_SCHEMAS

MISSING_RESULT = INTERRUPTED
"""A job folder without result.json: killed, preempted, or still running."""


@dataclass
class JobRow:
    folder: Path
    job: int | None
    overrides: list[str]
    status: str
    monitor: str
    mode: str
    """min or max: which way the monitored metric improves."""
    best: float | None
    best_step: int | None
    steps: int | None
    wall_time_s: float | None
    final: dict[str, float] = field(default_factory=dict)
    """The last evaluation's metrics."""
    task: str | None = None
    """The job's ``task.name`` (a sweep over ``task=glue_cola,glue_rte,...`` gets one table of tasks)."""
    at_best: dict[str, float] = field(default_factory=dict)
    """The metrics of the evaluation where the monitored one was best (what ``checkpoint.export=best``
    exports)."""
    curve: list[tuple[int, float]] = field(default_factory=list)
    """The monitored metric at each evaluation."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """train/loss at each log line."""
    exported: dict[str, Any] | None = None
    """What the job's ``model/`` holds (``result.json``'s ``exported``: weights, checkpoint, step, metrics)."""
    search_space: dict[str, str] = field(default_factory=dict)
    """An Optuna sweep's space, key -> Hydra's sweep syntax (``tag(log, interval(3e-4, 3e-2))``): what
    the sweep's plot reads each parameter's scale from."""

    @property
    def params(self) -> dict[str, str]:
        """The job's overrides as key -> value (what a sweep varies)."""
        return dict(o.lstrip("+~").split("=", 1) for o in self.overrides if "=" in o)

    @property
    def pruned_step(self) -> int | None:
        """The optimizer step at which a pruned sweep's pruner stopped this job (None: not pruned)."""
        return self.steps if self.status == PRUNED else None

    def objective(self) -> float | None:
        """The best monitored value of a finished job, for ranking; None for a job that failed, ended
        on a NaN loss, was pruned or did not finish (they never win a sweep)."""
        if self.status != FINISHED or self.best is None or not math.isfinite(self.best):
            return None
        return self.best


def _yaml(path: Path) -> Any:
    import yaml  # type: ignore[import-untyped]

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def _number(value: Any) -> float | None:
    """A metric value as a float; metrics.jsonl writes NaN and infinities as strings."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def read_events(folder: Path) -> list[dict[str, Any]]:
    path = metrics_file(folder)
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return events


def job_folders(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep: those where Hydra saved a job's overrides (any depth, since
    ``hydra.sweep.subdir`` may nest them)."""
    found = [p.parent.parent for p in sweep_dir.rglob(f"{HYDRA_DIR}/{HYDRA_OVERRIDES}")]
    return [f for f in found if f != sweep_dir and CHECKPOINTS_DIR not in f.relative_to(sweep_dir).parts]


def read_job(folder: Path) -> JobRow:
    overrides = _yaml(hydra_file(folder, HYDRA_OVERRIDES)) or []
    config = _yaml(hydra_file(folder, HYDRA_CONFIG)) or {}
    hydra = (_yaml(hydra_file(folder, HYDRA_SETTINGS)) or {}).get("hydra", {})
    result = read_result(folder) or {}
    stopping = config.get("early_stopping", {}) if isinstance(config, dict) else {}
    monitor = str(result.get("monitor") or stopping.get("monitor", "eval/accuracy"))
    mode = str(result.get("mode") or stopping.get("mode", "max"))
    job = hydra.get("job", {}).get("num") if isinstance(hydra, dict) else None
    if job is None and folder.name.isdigit():
        job = int(folder.name)

    events = read_events(folder)
    curve = [(int(e["step"]), v) for e in events if (v := _number(e.get(monitor))) is not None]
    losses = [(int(e["step"]), v) for e in events if (v := _number(e.get("train/loss"))) is not None]
    evaluations = [e for e in events if monitor in e]
    finite = [(step, v) for step, v in curve if math.isfinite(v)]
    best_step, best = (None, None)
    if isinstance(result.get("best_step"), int) and isinstance(result.get("best"), (int, float)):
        best_step, best = result["best_step"], float(result["best"])  # the run's own word for it
    elif finite:
        # The first evaluation that reached the best value (the run's rule: app.engine.triggers).
        pick = max if mode == "max" else min
        best = pick(v for _, v in finite)
        best_step = next(step for step, v in finite if v == best)
    final = {k: v for k, v in evaluations[-1].items() if k not in ("step", "epoch")} if evaluations else {}
    at_best = next((e for e in evaluations if best_step is not None and int(e["step"]) == best_step), {})
    task = config.get("task", {}).get("name") if isinstance(config, dict) and isinstance(config.get("task"), dict) \
        else None
    sweeper = hydra.get("sweeper") if isinstance(hydra, dict) else None
    space = sweeper.get("params") if isinstance(sweeper, dict) else None
    steps = result.get("steps")
    if steps is None and events:
        steps = max(int(e["step"]) for e in events if e.get("step") is not None)
    return JobRow(
        folder=folder, job=int(job) if job is not None else None, overrides=[str(o) for o in overrides],
        status=str(result.get("status", MISSING_RESULT)), monitor=monitor, mode=mode, best=best,
        best_step=best_step, steps=steps, wall_time_s=result.get("wall_time_s"),
        final={k: f for k, v in final.items() if (f := _number(v)) is not None}, curve=curve, losses=losses,
        task=str(task) if task is not None else None,
        at_best={k: f for k, v in at_best.items() if k not in ("step", "epoch") and (f := _number(v)) is not None},
        exported=result["exported"] if isinstance(result.get("exported"), dict) else None,
        search_space={str(k): str(v) for k, v in space.items()} if isinstance(space, dict) else {},
    )


def read_sweep(sweep_dir: Path) -> list[JobRow]:
    rows = [read_job(f) for f in job_folders(sweep_dir)]
    return sorted(rows, key=lambda r: (r.job is None, r.job if r.job is not None else 0, str(r.folder)))


NOT_SWEPT = ("resume",)
"""Keys that differ between jobs without being searched (a resumed sweep's later jobs have resume=auto)."""


def swept_keys(rows: list[JobRow]) -> list[str]:
    """Override keys whose value differs between jobs (or that only some jobs set), in the order
    they first appear."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.params if k not in keys and k not in NOT_SWEPT]
    return [k for k in keys if len({row.params.get(k) for row in rows}) > 1]


def ranked(rows: list[JobRow]) -> list[JobRow]:
    """Best first by the objective (direction from early_stopping.mode); jobs without one last."""
    def key(row: JobRow) -> tuple[int, float]:
        value = row.objective()
        if value is None:
            return (1, 0.0)
        return (0, -value if row.mode == "max" else value)

    return sorted(rows, key=key)


def best_row(rows: list[JobRow]) -> JobRow | None:
    """The finished job with the best objective."""
    finished = [r for r in ranked(rows) if r.objective() is not None]
    return finished[0] if finished else None


def not_comparable(rows: list[JobRow]) -> str | None:
    """When the sweep's objective does not compare across its jobs, the sentence that says so: a swept
    key changes the monitored metric's scale (``task=dpo``'s ``eval/loss`` with ``task.beta``: the job
    with the smallest loss is no better model), and which metric does compare. None: it compares."""
    tasks = {row.task for row in rows}
    if len(tasks) != 1 or (task := next(iter(tasks))) not in TASK_SCHEMAS:
        return None
    schema = TASK_SCHEMAS[task]()
    monitor = rows[0].monitor
    scaling = [key for key in swept_keys(rows) if key in schema.keys_scaling(monitor)]
    if not scaling:
        return None
    instead = schema.comparable_metric()
    then = (f"; rank by one that does: early_stopping.monitor={instead} (docs/{task}.md)" if instead
            and instead != monitor else "")
    return (f"{monitor} does not compare across {', '.join(scaling)} (its value changes {monitor}'s scale), so the "
            f"best by it is not the best model{then}.")
