"""Experiment trackers behind one small interface: ``log(values, step)``, ``log_artifacts(folder)``
(a no-op where the tracker keeps no files) and ``finish()``.

Only the main process creates trackers, so every event is written once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from app.run_folder.layout import MLFLOW_DB, metrics_file, tensorboard_dir

log = logging.getLogger(__name__)


class Tracker:
    name = "base"
    tracker: Any = None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` at ``step``; ``kwargs``: arguments of this tracker's own log call
        (``Accelerator.log(log_kwargs={name: ...})``), refused by a tracker that has none."""
        raise NotImplementedError

    def refuse(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(f"log_kwargs for the {self.name} tracker: it takes no arguments ({', '.join(kwargs)}); "
                             f"remove log_kwargs[{self.name!r}].")

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Keep a copy of ``local_dir``'s files with the run (under ``artifact_path``), where the tracker
        stores files; the others keep none."""

    def log_table(self, key: str, rows: list[dict[str, str]], step: int, file: Path) -> None:
        """Record a small table of text (``rows``, the same keys each) at ``step``, also written as JSON Lines
        to ``file`` in the run folder: TensorBoard as text, W&B as a table, MLflow as an artifact; the
        others keep nothing more than the file."""

    def finish(self) -> None:
        pass


class JsonlTracker(Tracker):
    """One JSON object per line and event; appends, so a resumed run continues the same file."""

    name = "jsonl"

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tracker = path.open("a", encoding="utf-8")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            self.refuse(kwargs)
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self.tracker.write(json.dumps(record) + "\n")
        self.tracker.flush()

    def finish(self) -> None:
        self.tracker.close()


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, logging_dir: Path, project_name: str, config: dict[str, Any],
                 init_kwargs: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # init_kwargs={"purge_step": N} (a resumed run) hides events at steps >= N that the
        # interrupted run wrote after its last checkpoint.
        self.tracker = SummaryWriter(log_dir=str(tensorboard_dir(logging_dir)), **(init_kwargs or {}))
        if config:
            self.tracker.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``kwargs``: ``SummaryWriter.add_scalar``'s (``walltime``, ``new_style``, ``double_precision``)."""
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tracker.add_scalar(key, value, global_step=step, **kwargs)
        self.tracker.flush()

    def log_table(self, key: str, rows: list[dict[str, str]], step: int, file: Path) -> None:
        self.tracker.add_text(key, markdown_table(rows), global_step=step)
        self.tracker.flush()

    def finish(self) -> None:
        self.tracker.close()


def markdown_table(rows: list[dict[str, str]]) -> str:
    """``rows`` as a Markdown table (TensorBoard's text plugin renders it), each cell on one line."""
    if not rows:
        return ""

    def cell(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class WandbTracker(Tracker):
    """Weights & Biases, offline unless the user configured an online mode or an API key."""

    name = "wandb"

    def __init__(self, logging_dir: Path, project_name: str, config: dict[str, Any], init_kwargs: dict[str, Any]):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("logging.trackers has wandb, but the wandb package is not installed; "
                               "pip install wandb, or remove it from logging.trackers.") from err
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            init_kwargs = {"mode": "offline", **init_kwargs}
        self.tracker = wandb.init(project=project_name, dir=str(logging_dir), config=config, **init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.tracker.log(values, step=step, **kwargs)  # wandb.log's commit, sync

    def log_table(self, key: str, rows: list[dict[str, str]], step: int, file: Path) -> None:
        import wandb

        columns: list[str | int] = list(rows[0]) if rows else []
        self.tracker.log({key: wandb.Table(columns=columns, data=[[row.get(str(c), "") for c in columns] for row in rows])},
                         step=step)

    def finish(self) -> None:
        self.tracker.finish()


MLFLOW_MISSING = ("logging.trackers has mlflow, but the mlflow package is not installed; pip install -e \".[mlflow]\" "
                  "(or pip install mlflow), or remove it from logging.trackers.")
MLFLOW_RUN_FOLDER_TAG = "app.run_folder"
"""The tag naming the run folder an MLflow run belongs to: a resumed run continues the MLflow run that has it."""


class MLflowTracker(Tracker):
    """MLflow, with Accelerate's ``MLflowTracker``'s public shape (``tracker`` is the MLflow run;
    ``store_init_configuration``, ``log``, ``log_artifacts``, ``log_artifact``, ``finish``) and its
    arguments (``experiment_name``, ``run_id``, ``tags``, ``run_name``, ``description``, and their
    ``MLFLOW_*`` variables), through an ``MlflowClient`` of its own: no process-wide tracking URI or
    active run is set, so two trackers in one process (a sweep's jobs) stay apart.

    ``tracking_uri``: a tracking server or a backend store; default ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<the folder above logging_dir>/mlflow.db``. On a SQLite store the runs' files go to
    ``mlartifacts/`` beside the database, where ``mlflow ui --backend-store-uri sqlite:///...`` finds
    them. ``resume=True`` continues the MLflow run tagged with the same run folder (a resumed training
    run), keeping the parameters it was started with.
    """

    name = "mlflow"

    def __init__(self, logging_dir: Path, project_name: str, config: dict[str, Any], *,
                 tracking_uri: str | None = None, experiment_name: str | None = None, run_id: str | None = None,
                 tags: dict[str, Any] | str | None = None, run_name: str | None = None,
                 description: str | None = None, resume: bool = False):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError(MLFLOW_MISSING) from err
        folder = Path(logging_dir).absolute()
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder.parent / MLFLOW_DB}"
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name) or project_name
        run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        all_tags = {MLFLOW_RUN_FOLDER_TAG: str(folder), **(json.loads(tags) if isinstance(tags, str) else tags or {})}
        if description:
            all_tags["mlflow.note.content"] = description  # what mlflow.start_run(description=...) sets
        _quiet_store_migrations()
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        experiment_id = self._experiment(experiment_name, uri)
        if run_id is None and resume:
            run_id = self._run_of_folder(experiment_id, str(folder))
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=run_name,
                                         tags={k: str(v) for k, v in all_tags.items()})
        else:
            self.client.update_run(run_id, status="RUNNING")
            run = self.client.get_run(run_id)
        self.run_id: str = run.info.run_id
        self.tracker = run
        if config:
            self.store_init_configuration(config)

    def _experiment(self, name: str, uri: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        from mlflow.exceptions import MlflowException

        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        try:
            return str(self.client.create_experiment(name, artifact_location=location))
        except MlflowException:  # created meanwhile by another job of the sweep
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _run_of_folder(self, experiment_id: str, folder: str) -> str | None:
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_RUN_FOLDER_TAG}` = '{folder}'",
                                       max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The config as parameters, flattened (``trainer.batch_size``). A resumed run keeps the values
        it was started with (MLflow refuses to change a parameter): only new keys are added."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        logged = self.client.get_run(self.run_id).data.params
        params, changed = [], []
        for key, value in flatten(values).items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                log.warning("not logging the parameter %s to mlflow: its value has %d characters (mlflow keeps %d)",
                            key, len(text), MAX_PARAM_VAL_LENGTH)
            elif key not in logged:
                params.append(Param(key, text))
            elif logged[key] != text:
                changed.append(key)
        if changed:
            log.info("mlflow keeps the parameters this run was started with; changed on resume: %s", ", ".join(changed))
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """The numbers among ``values`` as metrics at ``step`` (others are skipped, as Accelerate does)."""
        if kwargs:
            self.refuse(kwargs)
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(_plain(v) if hasattr(v, "item") else v), now, step or 0)
                   for key, v in values.items() if _is_number(v)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_artifacts(self, local_dir: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_table(self, key: str, rows: list[dict[str, str]], step: int, file: Path) -> None:
        self.log_artifact(file, file.parent.name)  # samples/step_<N>.jsonl

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _quiet_store_migrations() -> None:
    """A new SQLite store is created by alembic's migrations, which log a line each at INFO."""
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _is_number(value: Any) -> bool:
    if hasattr(value, "numel"):
        return bool(value.numel() == 1)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"batch_size": 32}}`` -> ``{"trainer.batch_size": 32}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable
    return value


def build_trackers(names: list[str], project_name: str, logging_dir: Path, config: dict[str, Any],
                   init_kwargs: dict[str, Any]) -> list[Tracker]:
    trackers: list[Tracker] = []
    for name in names:
        if name == "jsonl":
            trackers.append(JsonlTracker(metrics_file(logging_dir)))
        elif name == "tensorboard":
            trackers.append(TensorBoardTracker(logging_dir, project_name, config, init_kwargs.get("tensorboard")))
        elif name == "wandb":
            trackers.append(WandbTracker(logging_dir, project_name, config, init_kwargs.get("wandb", {})))
        elif name == "mlflow":
            trackers.append(MLflowTracker(logging_dir, project_name, config, **init_kwargs.get("mlflow", {})))
        else:
            raise ValueError(f"unknown tracker {name!r}; expected jsonl, tensorboard, wandb or mlflow.")
    return trackers
