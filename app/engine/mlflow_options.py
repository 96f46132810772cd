"""The MLflow run a training run opens (``logging.trackers=[mlflow]``): its store, name and tags.

The store is ``logging.mlflow_tracking_uri`` (``app.cli.job`` fills in the default,
``sqlite:///<outputs>/mlflow.db``: see ``app.run_folder.layout.mlflow_store``). Every run goes to the
experiment ``logging.project_name``, a sweep's jobs too, each tagged with its sweep folder and
number, so ``mlflow ui`` lists single runs and sweep jobs side by side and a sweep filters as
``tags.sweep = '<folder>'``. The run's name is its folder's path below the store's folder
(``multirun/<date>/<time>/3``), else the folder's name.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from app.config import RunConfig, Tracker
from app.engine.run_record import read_run_record


def mlflow_kwargs(cfg: RunConfig, run_dir: Path, resumed: bool) -> dict[str, Any]:
    """``init_trackers``' options for the mlflow tracker (none when it is not used). ``resumed``: the run
    continues from a checkpoint, and so does its MLflow run."""
    if Tracker.mlflow not in cfg.logging.trackers:
        return {}
    uri = cfg.logging.mlflow_tracking_uri
    record = read_run_record(run_dir)
    tags = {"task": cfg.task.name, "hardware": cfg.hardware.kind.value,
            "processes": str(cfg.hardware.num_processes * cfg.hardware.num_nodes), "precision": cfg.precision.mode.value,
            "adapter": cfg.adapter.kind.value}
    if record is not None and record.sweep_dir is not None:
        tags.update({"sweep": str(Path(record.sweep_dir).absolute()), "sweep_job": str(record.job)})
    return {"mlflow": {"tracking_uri": uri, "tags": tags, "run_name": run_name(run_dir, uri), "resume": resumed}}


def run_name(run_dir: Path, uri: str | None) -> str:
    """The run folder below a SQLite store's folder (``2026-12-01/10-00-00``), else its name."""
    folder = run_dir.absolute()
    if uri is not None and uri.startswith("sqlite:///"):
        store = Path(uri.removeprefix("sqlite:///")).parent
        if folder.is_relative_to(store):
            return str(folder.relative_to(store))
    return folder.name


def mlflow_location(cfg: RunConfig) -> str | None:
    """Where the mlflow tracker writes and how to look at it, said once at the start (None without
    it): the default store is beside the run folders (``runs/mlflow.db`` for a run in ``runs/x``), which
    nothing else tells the user."""
    if Tracker.mlflow not in cfg.logging.trackers or cfg.logging.mlflow_tracking_uri is None:
        return None
    uri = cfg.logging.mlflow_tracking_uri
    said = f"mlflow: this run goes to {uri} (experiment {cfg.logging.project_name})"
    if uri.startswith(("sqlite:///", "file:")) or "://" not in uri:
        said += f"; see it with: mlflow ui --backend-store-uri {shlex.quote(uri)}"
    return said
