"""``logging.trackers=[mlflow]`` against the real mlflow package and its SQLite backend store: a
3-job sweep lands in one experiment of the default store (``<outputs>/mlflow.db``) with each job's
flattened config, metrics per step, tags and exported model; a resumed run continues its MLflow run;
without mlflow installed the tracker is refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import ConfigError, LoggingConfig, Tracker
from app.distributed import Accelerator
from app.run_folder.layout import mlflow_store
from tests.conftest import run_app

mlflow = pytest.importorskip("mlflow")


def test_the_tracker_logs_params_metrics_and_artifacts_and_a_resumed_run_continues(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "README.md").write_text("# a card\n")
    options = {"mlflow": {"tracking_uri": uri, "tags": {"task": "digits"}, "run_name": "run"}}
    acc = Accelerator(cpu=True, project_dir=run_dir, log_with="mlflow")
    acc.init_trackers("demo", config={"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 3}, init_kwargs=options)
    acc.log({"train/loss": 1.5, "epoch": 0, "note": "skipped"}, step=3)
    acc.get_tracker("mlflow").log_artifacts(run_dir / "model", "model")
    acc.end_training()
    # Resumed: the same MLflow run goes on; a changed parameter keeps the value it started with.
    again = Accelerator(cpu=True, project_dir=run_dir, log_with="mlflow")
    again.init_trackers("demo", config={"optim": {"lr": 0.2}, "trainer": {"max_steps": 9}},
                        init_kwargs={"mlflow": {**options["mlflow"], "resume": True}})
    again.log({"train/loss": 1.25}, step=4)
    again.end_training()

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run" and run.data.tags["task"] == "digits"
    assert run.data.params == {"optim.lr": "0.1", "optim.betas": "[0.9, 0.99]", "seed": "3", "trainer.max_steps": "9"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(3, 1.5), (4, 1.25)]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/README.md"]
    assert (tmp_path / "mlartifacts").is_dir()  # beside the database, where `mlflow ui` looks


def test_the_default_store_holds_every_run_and_every_sweep_job_side_by_side(tmp_path):
    # conf/config.yaml's folders: outputs/<date>/<time> and outputs/multirun/<date>/<time>
    outputs = tmp_path / "outputs"
    assert mlflow_store(outputs / "multirun/d/t/2", outputs / "d/t", outputs / "multirun/d/t") == \
        f"sqlite:///{outputs / 'mlflow.db'}"
    assert mlflow_store(tmp_path / "run", tmp_path / "run", Path("/elsewhere/sweep")).startswith("sqlite:///")


@pytest.mark.timeout(200)
def test_a_run_says_once_where_its_store_is_and_how_to_look_at_it(tmp_path):
    proc = run_app("logging.trackers=[mlflow]", "trainer.max_steps=3", "hydra.run.dir=runs/x", "logging.print_config=false",
                   "logging.progress_bar=false", cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Outside the run folder: the folder holding both hydra.run.dir and the default hydra.sweep.dir (outputs/...).
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    said = f"mlflow: this run goes to {uri} (experiment app); see it with: mlflow ui --backend-store-uri {uri}"
    assert (proc.stdout + proc.stderr).count(said) == 1, proc.stdout[-3000:]
    assert (tmp_path / "runs" / "x" / "app.log").read_text().count(said) == 1
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("app").experiment_id])
    assert run.info.run_name == "runs/x" and run.info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mlflow_search_runs_lists_a_three_job_sweep_with_its_metrics_params_and_models(tmp_path):
    sweep = tmp_path / "sweep"
    run_app("-m", "optim.lr=1e-3,3e-3,1e-2", "logging.trackers=[mlflow]", "trainer.max_steps=6",
            "trainer.eval_every_n_steps=3", "trainer.log_every_n_steps=3", "logging.progress_bar=false",
            "logging.print_config=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=True, timeout=280)
    # hydra.run.dir (outputs/<date>/<time>) and the sweep folder meet in tmp_path: the store is there.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:
        runs = mlflow.search_runs(experiment_names=["app"], order_by=["params.`optim.lr` ASC"])
    finally:
        mlflow.set_tracking_uri(None)
    assert len(runs) == 3 and list(runs["status"]) == ["FINISHED"] * 3
    assert list(runs["params.optim.lr"]) == ["0.001", "0.003", "0.01"]
    assert list(runs["tags.sweep"]) == [str(sweep)] * 3 and sorted(runs["tags.sweep_job"]) == ["0", "1", "2"]
    assert set(runs["tags.task"]) == {"digits"} and set(runs["tags.hardware"]) == {"cpu"}
    assert sorted(runs["tags.mlflow.runName"]) == ["sweep/0", "sweep/1", "sweep/2"]
    for _, row in runs.iterrows():
        job = sweep / row["tags.sweep_job"]
        final = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in x][-1]
        assert row["metrics.eval/accuracy"] == final["eval/accuracy"]
        assert row["params.trainer.max_steps"] == "6" and row["params.task.name"] == "digits"
        artifacts = Path(row["artifact_uri"].removeprefix("file://")) / "model"
        assert (artifacts / "model.safetensors").read_bytes() == (job / "model" / "model.safetensors").read_bytes()
        card = (artifacts / "README.md").read_text()
        assert f"Job {row['tags.sweep_job']} of the sweep `{sweep}`" in card and "python -m app optim.lr=" in card


def test_without_mlflow_the_tracker_is_one_sentence_naming_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError) as refused:
        LoggingConfig(trackers=[Tracker.mlflow]).check()
    assert str(refused.value) == ('logging.trackers=mlflow needs the mlflow package, which is not installed; pip install '
                                  '-e ".[mlflow]" (or pip install mlflow), or remove mlflow from logging.trackers.')
