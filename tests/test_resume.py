"""Resuming training runs: exact after SIGKILL anywhere (during a background checkpoint write too),
in the original run folder, with clear errors for unusable checkpoints. Where processes and exit
codes matter, runs are real ``python -m app`` subprocesses; the rest call ``app.engine.run.run`` in-process (faster)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli.argv import argv_for_resume
from app.distributed.checkpoint.store import (
    FAULT_ENV,
    HOLD_MESSAGE,
    CheckpointError,
    complete_checkpoints,
    next_save_number,
)
from app.engine.run import run as run_in_process
from tests.conftest import compose_config, run_app
from tests.helpers.metrics_rows import metrics_rows, without_throughput

# 2 epochs of 45 steps; step checkpoints every 7 steps fall mid-epoch, log lines every 5 steps span
# checkpoints (so the partial loss window must be restored), dropout and shuffling are on, and the
# evaluated and exported weights are a moving average that the checkpoints must carry too.
ARGS = ("trainer.max_epochs=2", "checkpoint.every_n_steps=7", "checkpoint.total_limit=2",
        "trainer.log_every_n_steps=5", "logging.progress_bar=false", "early_stopping.patience=null",
        "trainer.ema_decay=0.9")


events = metrics_rows


def logged(run_dir: Path) -> list[dict]:
    """What must match between runs: every logged value except throughput."""
    return without_throughput(events(run_dir))


def killed_by_fault(cwd: Path, root: Path, point: str, *args: str) -> None:
    number = next_save_number(root) + 1  # the second save of this process
    proc = run_app(*args, cwd=cwd, env={FAULT_ENV: f"{point}:{number}"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def killed_from_outside(cwd: Path, root: Path, *args: str) -> None:
    """SIGKILL as soon as two more checkpoints exist: somewhere mid-epoch, maybe mid-save."""
    target = next_save_number(root) + 2
    proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        if next_save_number(root) >= target:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"


def killed_during_background_write(cwd: Path, root: Path, run: Path, *args: str) -> None:
    """SIGKILL while a checkpoint is written in the background (checkpoint.async_save, the default):
    its write is held halfway on the writer thread, training goes on (a log line after the save's
    step), then the kill. The checkpoint being written never counts; the one before it stays the newest."""
    number = next_save_number(root) + 1  # the second save of this process
    err = cwd / "held.err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=stderr, env={**os.environ, FAULT_ENV: f"hold:{number}"})
    try:
        deadline = time.monotonic() + 180
        said = re.compile(rf"{HOLD_MESSAGE} \(save {number}, step (\d+),")
        while (held := said.search(err.read_text(errors="replace"))) is None:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.01)
        # The writer thread may say so only after the loop has logged past the save (a busy machine):
        # wait for a line after the save's own step, not for one after the message.
        held_step = int(held.group(1))
        while max(e["step"] for e in events(run)) <= held_step:  # the loop trains on meanwhile
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.01)
        assert not (root / f"checkpoint_{number}").exists()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert complete_checkpoints(root)[-1][1].save_number == number - 1
    assert any(p.name.startswith(f".tmp-checkpoint_{number}-") for p in root.iterdir())


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_anywhere_and_resumed_ends_bitwise_identical(tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    root = run / "checkpoints"
    run_app(*ARGS, f"hydra.run.dir={reference}", cwd=tmp_path, check=True)

    killed_by_fault(tmp_path, root, "files", *ARGS, f"hydra.run.dir={run}")  # half of the files written
    assert any(p.name.startswith(".tmp-checkpoint_") for p in root.iterdir())
    newest = complete_checkpoints(root)[-1][0]
    killed_by_fault(tmp_path, root, "before-rotate", f"resume={newest}")      # one checkpoint
    killed_during_background_write(tmp_path, root, run, f"resume={root}")
    killed_from_outside(tmp_path, root, *ARGS, "resume=auto", f"hydra.run.dir={run}")
    # The run's own overrides (every_n_steps, log_every_n_steps...) come back from .hydra/overrides.yaml.
    run_app(f"resume={root}", cwd=tmp_path, check=True)

    assert (run / "model" / "model.safetensors").read_bytes() == (reference / "model" / "model.safetensors").read_bytes()
    assert logged(run) == logged(reference)  # same losses and metrics, no step twice
    # Numbering continued as if the run had never stopped (Accelerate restarts at 0 after a resume).
    kept = [(m.save_number, m.step) for _, m in complete_checkpoints(root)]
    assert kept == [(m.save_number, m.step) for _, m in complete_checkpoints(reference / "checkpoints")]
    # The total_limit=2 newest, and those holding a best evaluation's weights (an epoch's evaluation, at
    # step 45 or 90) that the export reads or that a kept checkpoint records as its run's best (its resume
    # would export them).
    best_step = json.loads((reference / "result.json").read_text())["best_step"]
    recorded = {m.extra["best_step"] for _, m in complete_checkpoints(root)}
    assert recorded <= {45, 90} and kept[-1][0] == 13
    assert [step for _, step in kept] == sorted({84, 90, best_step} | recorded)
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert not (tmp_path / "outputs").exists()  # every resume wrote into the original run folder


# -- unusable checkpoints ------------------------------------------------------------------------------

BASE = ("trainer.max_epochs=2", "logging.progress_bar=false", "logging.trackers=[]")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """Two epochs, a checkpoint after each (the default), made with resume=auto on a new folder."""
    run = tmp_path_factory.mktemp("base") / "run"
    run_in_process(compose_config(*BASE, "resume=auto"), run)
    assert [m.step for _, m in complete_checkpoints(run / "checkpoints")] == [45, 90]
    return run


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_sentence(message: str) -> bool:
    return message.endswith((".", "?")) and "\n" not in message


def assert_refused(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and one_sentence(message) and fragment in message, message


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unusable_checkpoints_exit_2_with_one_sentence_and_nothing_changes(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    empty = tmp_path / "empty"
    empty.mkdir()
    # Refused before Hydra starts: no run folder is created anywhere.
    assert_refused(run_app(f"resume={empty}", cwd=tmp_path), "contains no checkpoint")
    newest = complete_checkpoints(run / "checkpoints")[-1][0]
    weights = newest / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-8] + bytes(8))  # same size, other bytes: found by the run's SHA-256 check
    assert_refused(run_app(f"resume={newest}", *BASE, cwd=tmp_path), "SHA-256")
    weights.write_bytes(data)
    after = snapshot(run)
    assert {k: v for k, v in after.items() if k != "app.log" and not k.startswith(".hydra")} == before
    assert not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_paths_without_a_usable_checkpoint_are_refused_before_hydra(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    with pytest.raises(CheckpointError, match="does not exist") as err:
        argv_for_resume([f"resume={tmp_path / 'nowhere'}"])
    assert one_sentence(str(err.value))
    newest = complete_checkpoints(run / "checkpoints")[-1][0]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as err:
        argv_for_resume([f"resume={newest}"])
    assert one_sentence(str(err.value)) and weights.exists()


def test_resume_argv_reuses_the_original_overrides_and_run_folder(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- trainer.max_epochs=2\n- task.dropout=0.2\n- resume=old\n")
    argv = argv_for_resume(["resume=" + str(run / "checkpoints"), "trainer.max_epochs=5", "-c", "job"])
    assert argv == ["task.dropout=0.2", f"resume={run / 'checkpoints'}", "trainer.max_epochs=5", "-c", "job",
                    f"hydra.run.dir={run}"]
    for untouched in (["resume=auto"], ["x=1"], [f"resume={run}", "hydra.run.dir=elsewhere"]):
        assert argv_for_resume(untouched) == untouched


@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_model_is_refused_before_loading(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    before = snapshot(run)
    cfg = compose_config(*BASE, "task.hidden_sizes=[64]", f"resume={run}")
    with pytest.raises(CheckpointError, match="another task or optimizer configuration") as err:
        run_in_process(cfg, run)
    assert one_sentence(str(err.value)) and snapshot(run) == before


@pytest.mark.timeout(180)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, caplog):
    run = copy_run(finished_run, tmp_path)
    (previous, _), (newest, manifest) = complete_checkpoints(run / "checkpoints")[-2:]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    with caplog.at_level(logging.INFO):
        run_in_process(compose_config(*BASE, "trainer.max_epochs=3", f"resume={run}"), run)
    assert f"skipping checkpoint {newest}" in caplog.text and f"resumed from {previous}" in caplog.text
    assert newest.exists()  # skipped, not deleted
    steps = [e["step"] for e in events(run) if "eval/accuracy" in e]
    assert steps == [45, 90, 135]  # epoch 2's lines were cut back and written once more, then epoch 3
    assert next_save_number(run / "checkpoints") > manifest.save_number + 1
