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
