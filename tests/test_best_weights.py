"""``checkpoint.export=best`` exports the best evaluation whatever the checkpoint schedule (issue 41):
evaluations every N steps between per-epoch checkpoints, or with checkpoints off, on 1 and 2
processes (DDP, FSDP2's shards), with a weight average, with LoRA, and after a SIGKILL and a resume
between the best and the end. The exported file is compared byte for byte with the export of a run
stopped at the best evaluation (``checkpoint.export=last``, a constant learning rate): the weights
that evaluation measured.

With ``early_stopping.monitor=eval/loss`` and ``mode=max`` the best is the first evaluation (the loss
only falls), so it falls between saves: step 10 of digits' 45-step epochs."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from safetensors import safe_open

from app.distributed.checkpoint import best
from app.distributed.checkpoint.store import FAULT_ENV, complete_checkpoints, read_manifest
from app.engine.run import run
from tests.conftest import compose_config, run_app

FIRST_IS_BEST = ("logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false",
                 "scheduler=constant", "trainer.max_epochs=-1", "early_stopping.patience=null",
                 "early_stopping.monitor=eval/loss", "early_stopping.mode=max", "trainer.eval_every_n_steps=10")
BEST_STEP = 10


def exported(run_dir: Path, name: str = "model.safetensors") -> bytes:
    return (run_dir / "model" / name).read_bytes()


def described(run_dir: Path) -> dict:
    return json.loads((run_dir / "model" / "export.json").read_text())


def kept_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))


@pytest.fixture(scope="module")
def at_the_best(tmp_path_factory) -> dict[str, Path]:
    """Runs stopped at the best evaluation (step 10), exporting their last weights: plain and averaged."""
    folders = {}
    for name, extra in (("plain", ()), ("ema", ("trainer.ema_decay=0.9",))):
        folders[name] = tmp_path_factory.mktemp(f"at_best_{name}")
        run(compose_config(*FIRST_IS_BEST, *extra, f"trainer.max_steps={BEST_STEP}", "checkpoint.export=last"),
            folders[name])
    return folders


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, holder, folders", [
    # Checkpoints at epoch ends (45) and of the final state (60): the best (10) falls between them.
    ((), "best_10", ["best_10", "checkpoint_0", "checkpoint_1"]),
    # Checkpoints off: the best's weights are kept all the same (checkpoints/ holds them alone).
    (("checkpoint.every_epoch=false",), "best_10", ["best_10"]),
    # Checkpoints every 5 steps, one at the best's step: it holds the best, nothing else is written.
    (("checkpoint.every_n_steps=5", "checkpoint.every_epoch=false", "checkpoint.total_limit=1"),
     "checkpoint_1", ["checkpoint_1", "checkpoint_11"]),
], ids=["checkpoints-every-epoch", "checkpoints-off", "a-checkpoint-at-the-best"])
def test_the_export_holds_the_best_evaluations_weights_whatever_the_schedule(at_the_best, tmp_path, schedule, holder,
                                                                             folders):
    run(compose_config(*FIRST_IS_BEST, *schedule, "trainer.max_steps=60"), tmp_path)
    assert exported(tmp_path) == exported(at_the_best["plain"])
    said = described(tmp_path)
    assert (said["exported"], said["step"], said["final_step"], said["checkpoint"]) == ("best", 10, 60, holder)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["best_step"] == 10 and result["exported"]["step"] == 10 and result["exported"]["checkpoint"] == holder
    assert "these are the **best** weights, from step 10 of 60, eval/loss = " in (tmp_path / "model" / "README.md").read_text()
    # The run's length, not the exported evaluation's: 60 steps is one whole 45-step epoch (issue 51).
    assert "| length | 60 optimizer steps, 1 epoch(s) completed " in (tmp_path / "model" / "README.md").read_text()
    assert (said["epoch"], said["final_epoch"]) == (0, 1)
    assert f"(`checkpoints/{holder}`)." in (tmp_path / "model" / "README.md").read_text()
    # Rotation kept the holder (total_limit=1) and nothing more than needed.
    assert kept_folders(tmp_path) == folders
    if holder.startswith("best_"):
        manifest = read_manifest(tmp_path / "checkpoints" / holder)
        assert manifest.step == 10 and manifest.metric["value"] == said["metric"]["value"]


@pytest.mark.timeout(240)
def test_with_a_weight_average_the_export_is_the_average_the_best_evaluation_measured(at_the_best, tmp_path):
    run(compose_config(*FIRST_IS_BEST, "trainer.ema_decay=0.9", "trainer.max_steps=60"), tmp_path)
    assert described(tmp_path)["checkpoint"] == "best_10"
    assert exported(tmp_path) == exported(at_the_best["ema"])
    assert exported(tmp_path) != exported(at_the_best["plain"])  # the average, not the raw weights


@pytest.mark.timeout(240)
def test_a_better_evaluation_replaces_the_kept_one_and_a_tie_does_not(at_the_best, tmp_path, monkeypatch):
    """Scripted evaluations (the weights, saves and export are real): 0.5 at step 10, 0.7 at 20, a tie
    at 30, 0.6, then 0.9 at 50 and 0.8 at the final step 55. The kept weights move from step 10 to 20 to
    50; step 20's stay while the epoch checkpoint (45) records it as its run's best, and go with it.
    Saves are synchronous here: with ``checkpoint.async_save`` a save completes whenever its writer
    thread does, and a save of step 10 completing after step 20's evaluation rightly prunes step 10's
    weights at once (the sequence below is then one entry shorter, as CI once saw under load)."""
    from app.engine import loop

    scores = iter([0.5, 0.7, 0.7, 0.6, 0.9, 0.8])
    monkeypatch.setattr(loop, "evaluate", lambda c: {"eval/accuracy": next(scores)})
    kept_at: list[list[str]] = []
    original = best.prune

    def prune(root, needed):
        removed = original(root, needed)
        kept_at.append(sorted(p.name for p, _ in best.kept(root)))
        return removed

    monkeypatch.setattr(best, "prune", prune)
    args = (*FIRST_IS_BEST, "early_stopping.monitor=eval/accuracy", "checkpoint.total_limit=1",
            "checkpoint.async_save=false")
    run(compose_config(*args, "trainer.max_steps=55"), tmp_path)
    said = described(tmp_path)
    assert (said["step"], said["metric"]["value"], said["checkpoint"]) == (50, 0.9, "best_50")
    assert [m.extra["best_step"] for _, m in complete_checkpoints(tmp_path / "checkpoints")] == [50]
    # After each save: 10 kept; 20 replaces it; the epoch checkpoint (best 20) keeps 20; 50 kept, 20 still
    # needed by that checkpoint; the final checkpoint (best 50) rotates it away and 20 goes. Never 30 (a tie).
    assert kept_at == [["best_10"], ["best_20"], ["best_20"], ["best_20", "best_50"], ["best_50"]]
    assert kept_folders(tmp_path) == ["best_50", "checkpoint_1"]

    scores = iter([0.5, 0.7, 0.7, 0.6, 0.9])
    monkeypatch.setattr(loop, "evaluate", lambda c: {"eval/accuracy": next(scores)})
    reference = tmp_path / "at_50"
    run(compose_config(*args, "trainer.max_steps=50", "checkpoint.export=last"), reference)
    assert exported(tmp_path) == exported(reference)


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_killed_between_the_best_and_the_end_and_resumed_it_exports_the_best(at_the_best, tmp_path):
    """SIGKILL halfway through the second epoch checkpoint (step 90): the run resumes from the first
    (step 45, which records the best as step 10's) and exports step 10's kept weights at the end."""
    args = (*FIRST_IS_BEST, "trainer.max_steps=100", f"hydra.run.dir={tmp_path / 'run'}")
    killed = run_app(*args, cwd=tmp_path, env={FAULT_ENV: "files:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    checkpoints = complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert [(m.step, m.extra["best_step"]) for _, m in checkpoints] == [(45, 10)]
    assert [p.name for p, _ in best.kept(tmp_path / "run" / "checkpoints")] == ["best_10"]
    run_app(f"resume={tmp_path / 'run'}", cwd=tmp_path, check=True)
    said = described(tmp_path / "run")
    assert (said["exported"], said["step"], said["final_step"], said["checkpoint"]) == ("best", 10, 100, "best_10")
    assert exported(tmp_path / "run") == exported(at_the_best["plain"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hardware", ["multi_cpu", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_on_two_processes_the_export_holds_the_best_evaluations_weights(tmp_path, hardware):
    """DDP keeps the full weights from the main process; FSDP2 each rank's shards (``best_10/model/``)."""
    from app.launching.launch import launch  # python -m app's launch: 2 processes from its fork server

    args = (*FIRST_IS_BEST, f"hardware={hardware}", "hardware.num_processes=2")
    launch(compose_config(*args, f"trainer.max_steps={BEST_STEP}", "checkpoint.export=last"), tmp_path / "at_best")
    launch(compose_config(*args, "trainer.max_steps=40"), tmp_path / "run")
    said = described(tmp_path / "run")
    assert (said["step"], said["checkpoint"]) == (10, "best_10")
    kept = tmp_path / "run" / "checkpoints" / "best_10"
    assert read_manifest(kept).world_size == 2
    if hardware == "fsdp":
        assert sorted(p.name for p in (kept / "model").iterdir()) == [
            "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert exported(tmp_path / "run") == exported(tmp_path / "at_best")


@pytest.mark.timeout(300)
def test_with_lora_the_kept_weights_are_the_adapters_and_head_and_the_export_is_the_best(tmp_path):
    pytest.importorskip("peft")
    from tests.helpers.tiny_bert import make_tiny_bert, make_tiny_glue_tsv, synthetic_pairs

    data = make_tiny_glue_tsv(tmp_path / "data", n_train=64, n_val=21)
    model = make_tiny_bert(tmp_path / "bert", [s for _, a, b in synthetic_pairs(200, seed=3) for s in (a, b)])
    args = (*FIRST_IS_BEST, "task=glue_mrpc", f"task.data_dir={data}", f"task.model={model}",
            f"task.cache_dir={tmp_path / 'cache'}", "task.max_length=48", "adapter=lora", "optim.lr=5e-3",
            "trainer.batch_size=8", "trainer.eval_every_n_steps=3",
            # At this learning rate the tiny model's evaluation loss rises: its lowest is the first.
            "early_stopping.mode=min")
    # 8 steps an epoch: the evaluations at 3 and 6 fall before the epoch's checkpoint and the final one (7).
    run(compose_config(*args, "trainer.max_steps=3", "checkpoint.export=last"), tmp_path / "at_best")
    run(compose_config(*args, "trainer.max_steps=7"), tmp_path / "run")
    said = described(tmp_path / "run")
    assert (said["step"], said["final_step"], said["checkpoint"]) == (3, 7, "best_3")
    with safe_open(str(tmp_path / "run" / "checkpoints" / "best_3" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # Frozen weights never change: only the adapters and the classification head are kept.
    assert keys and all("lora_" in key or "classifier" in key for key in keys), sorted(keys)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert exported(tmp_path / "run", name) == exported(tmp_path / "at_best", name), name


@pytest.mark.timeout(120)
def test_total_limit_bounds_the_resumable_checkpoints_and_a_rotated_best_keeps_its_weights_only(tmp_path):
    """``checkpoint.total_limit=2 checkpoint.keep_best=false``: two checkpoints, not three. The first
    epoch's checkpoint (the best evaluation, step 12) leaves its weights as ``best_12`` when it rotates
    out, its optimizer state gone, and the export loads them."""
    run_app("checkpoint.total_limit=2", "checkpoint.keep_best=false", "trainer.max_epochs=4", "trainer.batch_size=128",
            "early_stopping.monitor=eval/loss", "early_stopping.mode=max", "early_stopping.patience=null",
            "logging.trackers=[]", "logging.progress_bar=false", "hydra.run.dir=run", cwd=tmp_path, check=True)
    run_dir = tmp_path / "run"
    assert kept_folders(run_dir) == ["best_12", "checkpoint_2", "checkpoint_3"]
    kept = read_manifest(run_dir / "checkpoints" / "best_12")
    assert list(kept.files) == ["model.safetensors"] and kept.step == 12 and kept.extra == {"holds": "weights"}
    said = described(run_dir)
    assert (said["exported"], said["step"], said["checkpoint"]) == ("best", 12, "best_12")
    with safe_open(run_dir / "checkpoints" / "best_12" / "model.safetensors", "pt") as weights, \
            safe_open(run_dir / "model" / "model.safetensors", "pt") as export:
        names = sorted(weights.keys())
        assert names == sorted(export.keys())
        assert all(weights.get_tensor(name).equal(export.get_tensor(name)) for name in names)
