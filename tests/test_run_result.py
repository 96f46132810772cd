"""What a run says it did when its best evaluation is not its last: ``result.json`` (steps trained, why
it stopped, which checkpoint was exported and its metrics), ``model/export.json``, the log, ``sweep.csv``
and ``sweep.md`` (issue 29, items 1 and 3); after a resume, and in Optuna trials.

One rule for the best everywhere: the first evaluation that reached the best value. Two trials of
one Optuna (grid) search show it: with ``early_stopping.monitor=eval/loss`` and ``mode=max`` the best
is the first evaluation, for a run that learns (its loss only falls) and for one whose learning rate
(1e-30) leaves every weight bit for bit as it was (every evaluation ties with the first). Both stop
on patience 2 at their third evaluation, counted from the first."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from app.distributed.checkpoint.store import complete_checkpoints
from app.engine.progress import human
from app.engine.run import run
from tests.conftest import compose_config, run_app
from tests.test_sweeps import read_csv

QUIET = ("logging.progress_bar=false", "logging.trackers=[]", "logging.print_config=false")
# An evaluation and a checkpoint every 10 steps; the best is the first evaluation (step 10); patience 2
# stops at step 30.
FIRST_IS_BEST = ("early_stopping.monitor=eval/loss", "early_stopping.mode=max", "early_stopping.patience=2",
                 "trainer.max_steps=60", "trainer.eval_every_n_steps=10", "checkpoint.every_n_steps=10",
                 "checkpoint.every_epoch=false", "checkpoint.total_limit=1", *QUIET)
LEARNS, TIES = "0.003", "1e-30"
STOPPED = "eval/loss did not improve for 2 evaluations (best "


def evaluations(folder: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's evaluations by step (without the epoch)."""
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: {k: v for k, v in e.items() if k.startswith("eval/")} for e in events if "eval/loss" in e}


@pytest.fixture(scope="module")
def search(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """The sweep folder and each trial's folder by its learning rate."""
    cwd = tmp_path_factory.mktemp("search")
    sweep = cwd / "sweep"
    run_app("-m", "hydra/sweeper=optuna", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.n_jobs=1", "hydra.sweeper.pruner=none", f"optim.lr=choice({LEARNS},{TIES})",
            *FIRST_IS_BEST, f"hydra.sweep.dir={sweep}", cwd=cwd, timeout=200, check=True)
    trials = {}
    for job in ("0", "1"):
        overrides = yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        trials[next(o.split("=", 1)[1] for o in overrides if o.startswith("optim.lr="))] = sweep / job
    return sweep, trials


@pytest.mark.timeout(240)
def test_an_optuna_trial_stopped_after_its_best_says_what_it_trained_and_what_it_exported(search):
    sweep, trials = search
    for lr, folder in trials.items():
        result = json.loads((folder / "result.json").read_text())
        measured = evaluations(folder)
        assert sorted(measured) == [10, 20, 30], lr
        assert result["status"] == "finished" and result["steps"] == 30, result
        assert result["stop_reason"].startswith(STOPPED), result
        assert result["best"] == measured[10]["eval/loss"] and result["best_step"] == 10, result
        assert result["exported"] == {"weights": "best", "checkpoint": "checkpoint_0", "step": 10,
                                      "metrics": measured[10]}, result
        log = (folder / "app.log").read_text()
        assert f"stopped: {result['stop_reason']}; best eval/loss = " in log and log.count("(step 10)") >= 1
    rows = read_csv(sweep)
    assert [(r["steps"], r["best_step"], r["status"]) for r in rows] == [("30", "10", "finished")] * 2
    markdown = (sweep / "sweep.md").read_text()
    best_job = trials[TIES].name  # eval/loss is highest untrained
    assert f"**Best: job {best_job}** (optim.lr={TIES}): eval/loss = " in markdown and "at step 10." in markdown
    # ... and what its model/ holds: that evaluation's weights, and where they were kept (issue 41).
    assert "at step 10. Its `model/` holds the weights of that evaluation (`checkpoints/checkpoint_0`)." in markdown
    assert markdown.count("| best (step 10) |") == 2, markdown


@pytest.mark.timeout(240)
def test_every_tie_names_the_first_evaluation_that_reached_the_best(search):
    """The trial whose weights never change: its three evaluations are equal to the last bit. Early stopping
    counts from the first, keep_best keeps its checkpoint (total_limit=1), and the export, export.json,
    result.json, the log and sweep.md all name step 10."""
    sweep, trials = search
    folder = trials[TIES]
    measured = evaluations(folder)
    assert measured[10] == measured[20] == measured[30]  # a tie, exactly
    assert [m.step for _, m in complete_checkpoints(folder / "checkpoints")] == [10, 30]  # the best + the newest
    described = json.loads((folder / "model" / "export.json").read_text())
    assert (described["exported"], described["step"], described["checkpoint"]) == ("best", 10, "checkpoint_0")
    assert described["final_step"] == 30
    log = (folder / "app.log").read_text()
    assert "exporting the best evaluation: step 10, eval/loss = " in log
    assert "exported the best weights (step 10, eval/loss = " in log
    result = json.loads((folder / "result.json").read_text())
    # Counted from step 10: stopped at 30 (from the tie at 20 it would have gone on to 40).
    assert result["steps"] == 30 and result["stop_reason"].startswith(STOPPED), result
    assert (result["best_step"], result["exported"]["step"]) == (10, 10)
    row = next(r for r in read_csv(sweep) if r["job"] == folder.name)
    assert row["best_step"] == "10"
    assert re.search(rf"\| {folder.name} \| {TIES} \| finished \| [\d.]+ \| 10 \| 30 \|", (sweep / "sweep.md").read_text())


@pytest.mark.timeout(240)
def test_a_resumed_run_counts_every_segment_and_exports_the_earlier_best(tmp_path, caplog):
    folder = tmp_path / "run"
    # The first segment ends at max_steps (20); the resumed one goes on to the early stop at 30.
    run(compose_config(*FIRST_IS_BEST, "trainer.max_steps=20"), folder)
    first = json.loads((folder / "result.json").read_text())
    assert (first["steps"], first["stop_reason"], first["exported"]["step"]) == (20, "reached trainer.max_steps (20 optimizer steps)", 10)
    with caplog.at_level(logging.INFO):
        run(compose_config(*FIRST_IS_BEST, "trainer.max_steps=60", f"resume={folder}"), folder)
    result = json.loads((folder / "result.json").read_text())
    measured = evaluations(folder)
    assert sorted(measured) == [10, 20, 30]
    assert result["steps"] == 30 and result["stop_reason"].startswith(STOPPED), result
    assert result["best_step"] == 10 and result["exported"] == {
        "weights": "best", "checkpoint": "checkpoint_0", "step": 10, "metrics": measured[10]}, result
    described = json.loads((folder / "model" / "export.json").read_text())
    assert (described["step"], described["final_step"], described["metrics"]) == (10, 30, measured[10])
    # "resumed" only where training went on; the export says it loads (issue 29, item 5).
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert [line for line in lines if "resumed from" in line] == [
        f"resumed from {folder / 'checkpoints' / 'checkpoint_1'} (step 20, epoch 0)"]
    assert "exporting the best evaluation: step 10, eval/loss = " in "\n".join(lines)
    assert next(line for line in lines if line.startswith("exporting")).endswith("(loading checkpoints/checkpoint_0)")

    # mode=eval of the run folder evaluates what the run exported (step 10's weights), not its newest
    # checkpoint (step 30), and says so; naming a checkpoint evaluates that one (issue 29, items 4 and 5).
    newest = folder / "checkpoints" / "checkpoint_2"
    assert max(complete_checkpoints(folder / "checkpoints"), key=lambda c: c[1].step)[0] == newest
    said = {10: f"evaluating the run's exported model {folder / 'model'} (best weights, step 10, eval/loss = "
                f"{human(measured[10]['eval/loss'])}); resume={folder / 'checkpoints'}/checkpoint_<N> evaluates "
                "a checkpoint instead",
            30: f"evaluating checkpoint {newest} (step 30, epoch 0)"}
    for source, step in ((folder, 10), (newest, 30)):
        caplog.clear()
        (tmp_path / f"eval-{step}").mkdir()  # Hydra's run folder
        with caplog.at_level(logging.INFO):
            run(compose_config(*FIRST_IS_BEST, "mode=eval", f"resume={source}"), tmp_path / f"eval-{step}")
        evaluated = json.loads((tmp_path / f"eval-{step}" / "eval_metrics.json").read_text())["metrics"]
        assert evaluated["eval/loss"] == pytest.approx(measured[step]["eval/loss"], rel=1e-5), step
        assert measured[10]["eval/loss"] != pytest.approx(measured[30]["eval/loss"], rel=1e-3)  # they differ
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert [line for line in lines if line.startswith("evaluating")] == [said[step]]
        assert not any("resumed from" in line for line in lines), lines
