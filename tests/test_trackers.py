"""Trackers write once, from the main process; wandb stays offline unless configured."""

from __future__ import annotations

import json

import pytest

from app.distributed import Accelerator


def test_jsonl_and_tensorboard_trackers(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["jsonl", "tensorboard"])
    acc.init_trackers("demo", config={"lr": 0.1})
    acc.log({"train/loss": 1.5, "epoch": 0}, step=3)
    acc.log({"train/loss": float("nan")}, step=4)
    acc.end_training()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 3, "train/loss": 1.5, "epoch": 0}, {"step": 4, "train/loss": "nan"}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.timeout(120)
def test_wandb_runs_offline_by_default(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="wandb")
    acc.init_trackers("demo", config={"lr": 0.1})
    assert acc.get_tracker("wandb").tracker.settings.mode == "offline"
    acc.log({"train/loss": 1.0}, step=1)
    acc.end_training()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_unknown_tracker_is_refused(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="mlflowx")
    with pytest.raises(ValueError, match="unknown tracker 'mlflowx'"):
        acc.init_trackers("demo")


@pytest.mark.timeout(180)
def test_a_table_of_samples_goes_to_tensorboard_wandb_and_mlflow(tmp_path, monkeypatch):
    """``Accelerator.log_table`` (task=sft's ``task.sample_prompts``): TensorBoard text (a Markdown table),
    a W&B table in the offline run, the JSON Lines file as an MLflow artifact under ``samples/``."""
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["tensorboard", "wandb", "mlflow"])
    acc.init_trackers("demo", init_kwargs={"mlflow": {"tracking_uri": uri}})
    rows = [{"prompt": "a | b\nc", "completion": "d"}]
    file = tmp_path / "samples" / "step_5.jsonl"
    file.parent.mkdir()
    file.write_text(json.dumps(rows[0]) + "\n")
    acc.log_table("eval/samples", rows, 5, file)
    run_id = acc.get_tracker("mlflow").run_id
    acc.end_training()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    (tag,) = [t for t in events.Tags()["tensors"] if "samples" in t]
    (event,) = events.Tensors(tag)
    assert event.step == 5
    assert event.tensor_proto.string_val[0].decode() == "| prompt | completion |\n|---|---|\n| a \\| b<br>c | d |"
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/table/eval/samples_*.table.json"))
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_5.jsonl"]
