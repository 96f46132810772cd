"""What a run leaves at its end: the exported weights (checkpoint.export best | last, described in
``model/export.json``) and a checkpoint of the final state, from which a run with a raised
``trainer.max_steps`` continues exactly."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from app.distributed.checkpoint.store import complete_checkpoints
from app.engine.run import run
from tests.conftest import compose_config

# 60 steps of a 45-step epoch: the run ends by max_steps mid-epoch. A constant learning rate, so that
# the schedule does not depend on max_steps.
FAST = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false", "scheduler=constant",
        "trainer.max_epochs=-1", "early_stopping.patience=null")


def test_export_best_takes_the_best_checkpoint_and_says_so(tmp_path):
    # The best by a maximised eval/loss is the first evaluation (step 10): the loss only falls.
    run(compose_config(*FAST, "trainer.max_steps=30", "trainer.eval_every_n_steps=10", "checkpoint.every_n_steps=10",
                       "early_stopping.monitor=eval/loss", "early_stopping.mode=max"), tmp_path)
    described = json.loads((tmp_path / "model" / "export.json").read_text())
    assert described["exported"] == "best" and described["step"] == 10 and described["final_step"] == 30
    assert described["metric"]["name"] == "eval/loss"
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert described["metric"]["value"] == next(e["eval/loss"] for e in events if e["step"] == 10 and "eval/loss" in e)
    exported = load_file(tmp_path / "model" / "model.safetensors")
    saved = load_file(tmp_path / "checkpoints" / described["checkpoint"] / "model.safetensors")
    assert exported.keys() == saved.keys() and all((exported[k] == saved[k]).all() for k in exported)
    final = complete_checkpoints(tmp_path / "checkpoints")[-1][1]
    assert final.step == 30  # and the final state is kept too


def test_a_max_steps_end_mid_epoch_leaves_a_checkpoint_that_a_longer_run_continues_exactly(tmp_path):
    last = ("checkpoint.export=last",)
    reference, extended = tmp_path / "reference", tmp_path / "extended"
    run(compose_config(*FAST, *last, "trainer.max_steps=35"), reference)
    run(compose_config(*FAST, *last, "trainer.max_steps=20"), extended)
    checkpoints = complete_checkpoints(extended / "checkpoints")
    assert [m.step for _, m in checkpoints] == [20]  # no epoch ended: only the final state
    described = json.loads((extended / "model" / "export.json").read_text())
    assert described["exported"] == "last" and described["step"] == 20
    run(compose_config(*FAST, *last, "trainer.max_steps=35", f"resume={extended}"), extended)
    assert ((extended / "model" / "model.safetensors").read_bytes()
            == (reference / "model" / "model.safetensors").read_bytes())
