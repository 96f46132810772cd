"""``examples/tabular``: a task from the user's own package and config folder, run through
``python -m app --config-dir conf task=tabular`` as the README shows, with no change to ``app/``: one
and two processes, an exact resume, ``mode=eval`` of the export, a sweep, and its config checked as
ours is (an unknown key, a wrong type, a value its own rule refuses)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, run_app

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false")


@pytest.fixture
def example(tmp_path) -> Path:
    """A copy of examples/tabular (the package and its config folder), where a user would cd to."""
    return shutil.copytree(REPO / "examples" / "tabular", tmp_path / "tabular",
                           ignore=shutil.ignore_patterns("outputs", "multirun", "__pycache__"))


def app(example: Path, *args: str, check: bool = True):
    return run_app("--config-dir", "conf", *args, *QUIET, cwd=example, check=check, timeout=200)


def evaluations(run: Path) -> list[dict]:
    return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in e]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_tabular_example_trains_resumes_evaluates_and_sweeps_from_its_own_folder(example):
    from safetensors.torch import load_file

    # The schedule stays the same however many epochs a segment runs: the resumed run can match.
    same = ("task=tabular", "scheduler=constant", "trainer.max_epochs=4")
    app(example, *same, "hydra.run.dir=through")
    app(example, "task=tabular", "scheduler=constant", "trainer.max_epochs=2", "hydra.run.dir=split")
    app(example, "resume=split", "trainer.max_epochs=4")  # the run's own overrides (task=tabular) are reused
    through, split = evaluations(example / "through"), evaluations(example / "split")
    assert [e["step"] for e in through] == [25, 50, 75, 100] and through[-1]["eval/accuracy"] > 0.8
    assert split == through  # bit for bit: losses, metrics, and the weights below
    weights = [load_file(example / run / "model" / "model.safetensors") for run in ("through", "split")]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])
    newest = max((example / "split" / "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    saved = json.loads((newest / "custom_checkpoint_0.json").read_text())
    assert set(saved) == {"mean", "std"} and len(saved["mean"]) == 16  # the task's own checkpointed state

    app(example, "mode=eval", "resume=split/model", "hydra.run.dir=evaluated")
    exported = json.loads((example / "split" / "model" / "export.json").read_text())
    measured = json.loads((example / "evaluated" / "eval_metrics.json").read_text())["metrics"]
    at_export = next(e for e in through if e["step"] == exported["step"])
    assert measured["eval/accuracy"] == at_export["eval/accuracy"] and measured["eval/num_samples"] == 400
    assert json.loads((example / "split" / "model" / "tabular.json").read_text())["config"]["features"] == 16

    app(example, "task=tabular", "hardware=multi_cpu", "hardware.num_processes=2", "trainer.max_epochs=1",
        "hydra.run.dir=two")
    assert (example / "two" / "app.log").read_text().count("training tabular on 2 process(es);") == 1
    assert [e["eval/num_samples"] for e in evaluations(example / "two")] == [400]  # every row once, over 2 ranks

    app(example, "-m", "task=tabular", "task.hidden_sizes=[32],[16,16]", "trainer.max_epochs=1", "hydra.sweep.dir=sweep")
    results = [json.loads((example / "sweep" / job / "result.json").read_text()) for job in ("0", "1")]
    assert [r["status"] for r in results] == ["finished", "finished"]
    assert "**Best: job" in (example / "sweep" / "sweep.md").read_text()


@pytest.mark.timeout(200)
def test_the_example_config_is_checked_as_ours_is(example):
    import os
    import subprocess
    import sys

    cases = {
        "+task.hiden=3": "unknown configuration key task.hiden: TabularConfig has the keys name, samples, features, "
                         "classes, class_separation, data_seed, eval_fraction, hidden_sizes, dropout.",
        "task.classes=x": "task.classes is refused by TabularConfig: Value 'x' of type 'str' could not be converted "
                          "to Integer.",
        "task.classes=1": "task.classes must be 2 or more, got 1.",
        "task._target_=tabular_task.Tabular": "task._target_=tabular_task.Tabular: module tabular_task has no Tabular.",
        "task.hiden=3": None,  # Hydra's own refusal of a typo, as for our tasks
    }
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = {override: subprocess.Popen([sys.executable, "-m", "app", "--config-dir", "conf", "task=tabular", override,
                                         *QUIET, f"hydra.run.dir=refused_{i}"], cwd=example, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i, override in enumerate(cases)}  # side by side, to save time
    for override, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        message = cases[override]
        if message is None:
            assert proc.returncode != 0 and "Key 'hiden' is not in struct" in err, err[-2000:]
            continue
        assert proc.returncode == 2 and "Traceback" not in err, (override, err[-2000:])
        assert err.strip().splitlines()[-1] == f"error: {message}", override
