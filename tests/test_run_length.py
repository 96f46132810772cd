"""How long a run trains, asked on the command line (issue 42, item 2): ``trainer.max_steps`` given
alone is not cut short by a task's preset ``max_epochs``; with both given, the start says which one
ends the run and the stop sentence names the one that did. ``task=causal_lm``'s own case (a 13-step
epoch, ``trainer.max_steps=37``) is in ``tests/test_causal_lm.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_app
from tests.helpers.metrics_rows import metrics_rows

QUIET = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false",
         "checkpoint.every_epoch=false", "checkpoint.save_final_model=false", "early_stopping.patience=null")


def ended(run: Path) -> tuple[int, str]:
    result = json.loads((run / "result.json").read_text())
    return result["steps"], result["stop_reason"]


@pytest.mark.timeout(120)
def test_max_steps_given_alone_trains_past_the_tasks_preset_epochs(tmp_path):
    # The whole training split in one batch: one optimizer step per epoch; digits' recipe says 20 epochs.
    proc = run_app("trainer.max_steps=25", "trainer.batch_size=1437", "hydra.run.dir=run", *QUIET, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ended(tmp_path / "run") == (25, "reached trainer.max_steps (25 optimizer steps)")
    # A task that does not describe its data gets its splits' sizes at the start (issue 42, item 11).
    assert "data: train: 1,437 samples; evaluation: 360 samples\n" in (tmp_path / "run" / "app.log").read_text()
    assert [row["step"] for row in metrics_rows(tmp_path / "run") if "eval/loss" in row] == list(range(1, 26))


@pytest.mark.timeout(180)
def test_with_both_limits_given_the_start_says_which_ends_the_run_and_the_stop_names_it(tmp_path):
    # digits: 45 optimizer steps per epoch at trainer.batch_size=32.
    for folder, epochs in (("epochs_first", 1), ("steps_first", 2)):
        proc = run_app(f"trainer.max_epochs={epochs}", "trainer.max_steps=60", f"hydra.run.dir={folder}", *QUIET,
                       cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "epochs_first" / "app.log").read_text()
    assert "trainer.max_epochs=1 ends training at optimizer step 45 (45 per epoch), before trainer.max_steps=60." in log
    assert ended(tmp_path / "epochs_first") == (45, "reached trainer.max_epochs (1 epoch, 45 optimizer steps)")
    assert "stopped: reached trainer.max_epochs (1 epoch, 45 optimizer steps); best" in log
    log = (tmp_path / "steps_first" / "app.log").read_text()
    assert ("trainer.max_steps=60 ends training, before trainer.max_epochs=2 would (90 optimizer steps, 45 per "
            "epoch).") in log
    assert ended(tmp_path / "steps_first") == (60, "reached trainer.max_steps (60 optimizer steps)")
