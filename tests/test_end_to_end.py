"""``python -m app`` as a user runs it: the default job, and a Hydra multirun sweep."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_app


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_job_trains_digits_offline_to_the_accuracy_bar(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_app(f"hydra.run.dir={run_dir}", cwd=tmp_path, check=True)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracies = [e["eval/accuracy"] for e in events if "eval/accuracy" in e]
    assert max(accuracies) >= 0.95
    assert {"eval/loss", "eval/f1", "epoch", "step"} <= set(next(e for e in events if "eval/accuracy" in e))
    assert any("train/loss" in e and "train/lr" in e for e in events)
    steps = [e["step"] for e in events if "train/loss" in e]
    assert steps == sorted(set(steps))  # one line per logged step
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / ".hydra" / "config.yaml").exists()
    log = (run_dir / "app.log").read_text()
    assert "eval/accuracy" in log and "stopped:" in log
    # Captured through a pipe, progress is plain log lines (a tenth of the run each), never a redrawn bar.
    progress = re.findall(r"\[INFO\] - train: (\d+)/(\d+) steps", proc.stdout)
    assert 5 <= len(progress) <= 10, proc.stdout[-3000:]
    assert [int(step) for step, _ in progress] == sorted({int(step) for step, _ in progress})
    assert "\r" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun_sweep_gives_one_folder_per_job_and_returns_the_metric(tmp_path):
    sweep = tmp_path / "sweep"
    run_app("-m", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}", "trainer.max_epochs=2",
            "logging.trackers=[]", "logging.progress_bar=false", cwd=tmp_path, check=True)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    lrs = []
    for job in jobs:
        assert (sweep / job / "metrics.jsonl").exists()
        overrides = (sweep / job / ".hydra" / "overrides.yaml").read_text()
        lrs.append(overrides)
    assert "optim.lr=0.001" in lrs[0] and "optim.lr=0.003" in lrs[1]
    assert (sweep / "multirun.yaml").exists()


def test_task_function_returns_the_monitored_metric(tmp_path):
    # Sweepers (Optuna...) optimise what the Hydra task function returns.
    from app.engine.run import run
    from tests.conftest import compose_config

    cfg = compose_config("trainer.max_epochs=2", "logging.trackers=[]", "logging.progress_bar=false")
    best = run(cfg, tmp_path)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert best == max(e["eval/accuracy"] for e in events if "eval/accuracy" in e)
