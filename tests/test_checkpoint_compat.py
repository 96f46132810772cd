"""Checkpoints written before checkpoints became one package (commit 9b0b569, see
tests/fixtures/checkpoints_9b0b569/README.md) still load and resume with the current code: the file
format, the manifest and the meaning of every saved state are unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from app.distributed.checkpoint.store import complete_checkpoints, read_state
from app.engine.build import build_accelerator, build_components, build_early_stopping
from app.engine.checkpoint import CheckpointPolicy
from app.engine.loop import LoopState
from tests.conftest import compose_config, run_app

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoints_9b0b569"


def overrides(layout: str) -> list[str]:
    return yaml.safe_load((FIXTURE / layout / ".hydra" / "overrides.yaml").read_text())


@pytest.mark.parametrize(("layout", "world_size"), [("single", 1), ("ddp", 2), ("fsdp", 2)])
def test_an_old_checkpoint_of_each_layout_loads_into_one_process(layout, world_size, tmp_path):
    # One process reads them all: DDP's full weights and FSDP2's weight shards alike.
    keep = [o for o in overrides(layout) if not o.startswith("hardware")]
    cfg = compose_config(*keep, "hardware=cpu")
    acc = build_accelerator(cfg, tmp_path)
    try:
        components = build_components(cfg, acc)
        state = LoopState()
        policy = CheckpointPolicy(cfg, components, state, build_early_stopping(cfg), tmp_path)
        manifest = policy.resume(str(FIXTURE / layout / "checkpoints" / "checkpoint_1"))
        assert manifest is not None
        assert (manifest.save_number, manifest.step, manifest.world_size) == (1, 6, world_size)
        assert (acc.step, state.global_step, state.epoch) == (6, 6, 0)
        # The data position: 6 global batches of the saved run, in this run's (1-process) batches.
        assert state.batches_in_epoch == 6 * world_size
        assert state.last_metrics["eval/accuracy"] == manifest.metric["value"]
        # The weights are exactly the saved ones (the export of the same step, read by safetensors itself).
        saved = load_file(FIXTURE / layout / "model" / "model.safetensors")
        loaded = acc.unwrap_model(components.model).state_dict()
        assert saved.keys() == loaded.keys()
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
        optimizer_state = components.optimizer.optimizer.state_dict()["state"]
        assert len(optimizer_state) == len(saved)
        assert {float(s["step"]) for s in optimizer_state.values()} == {6.0}
        assert components.scheduler.scheduler.last_epoch == 6
    finally:
        acc.end_training()


@pytest.mark.timeout(240)
def test_an_old_run_resumes_and_trains_on_to_the_same_weights(tmp_path):
    """Resuming the old run's step-3 checkpoint ends at step 6 with the weights the old code reached
    there (close, not bitwise: the fixture was made on another machine's CPU kernels)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "single", run)
    old_metrics = [json.loads(line) for line in (FIXTURE / "single" / "metrics.jsonl").read_text().splitlines()]
    run_app(f"resume={run / 'checkpoints' / 'checkpoint_0'}", cwd=tmp_path, check=True)

    kept = [(m.save_number, m.step) for _, m in complete_checkpoints(run / "checkpoints")]
    assert kept == [(0, 3), (1, 6), (2, 6)]  # numbering went on after the old checkpoints
    new = load_file(run / "checkpoints" / "checkpoint_2" / "model.safetensors")
    old = load_file(FIXTURE / "single" / "checkpoints" / "checkpoint_1" / "model.safetensors")
    assert new.keys() == old.keys()
    for name in old:
        torch.testing.assert_close(new[name], old[name], rtol=1e-5, atol=1e-6)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The step-3 line kept; then the training loss of steps 4-6 (the run ends before its next log
    # step, so its last window is logged at the end) and step 6's evaluation once more.
    assert [(m["step"], "train/loss" in m, "eval/loss" in m) for m in metrics] == [
        (3, False, True), (6, True, False), (6, False, True)]
    assert metrics[2]["eval/loss"] == pytest.approx(old_metrics[1]["eval/loss"], rel=1e-5)
    assert json.loads((run / "result.json").read_text())["steps"] == 6


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("layout", "weights"), [
    ("fsdp", ["model/shard-00001-model-00001-of-00001.safetensors", "model/shard-00002-model-00001-of-00001.safetensors"]),
    ("ddp", ["model.safetensors"]),
])
def test_an_old_two_process_run_resumes_on_two_processes_of_its_kind(layout, weights, tmp_path):
    """The old checkpoints load on the 2 processes that wrote them, as the saved run's own command
    resumes them: FSDP2's per-rank weight shards through FSDP2 itself (torch.distributed.checkpoint),
    DDP's full weights into both replicas; training goes on from step 6."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / layout, run)
    run_app(f"resume={run}", "trainer.max_steps=7", "checkpoint.export=last", cwd=tmp_path, check=True)

    kept = [(m.save_number, m.step, m.world_size) for _, m in complete_checkpoints(run / "checkpoints")]
    assert kept == [(1, 6, 2), (2, 7, 2)]
    newest = run / "checkpoints" / "checkpoint_2"
    saved = sorted(str(p.relative_to(newest)) for p in newest.rglob("*.safetensors"))
    assert [name for name in saved if name.startswith("model")] == weights
    assert json.loads((run / "result.json").read_text())["steps"] == 7
    # The old run's schedule (6 steps) ended at learning rate 0, so step 7 moves the optimizer's
    # counters but not the weights: what the old checkpoint held comes back out exactly.
    optimizer = read_state(run / "checkpoints" / "checkpoint_2", "optimizer")["state"]
    assert {float(s["step"]) for s in optimizer.values()} == {7.0}
    old = load_file(FIXTURE / layout / "model" / "model.safetensors")
    new = load_file(run / "model" / "model.safetensors")
    assert old.keys() == new.keys()
    for name, tensor in old.items():
        assert torch.equal(new[name], tensor), name
