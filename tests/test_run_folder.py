"""A run folder belongs to one run: a new run does not clobber an earlier one (unless overwrite=true,
which moves it aside), a refused resume leaves it byte for byte as it was, and a live run holds an
exclusive lock that a second run is refused by and that a SIGKILLed run's successor takes over."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.run_folder.claims import RunFolderError, RunFolderLock
from app.run_folder.layout import LOCK_FILE
from tests.conftest import run_app

ARGS = ("trainer.max_steps=2", "checkpoint.every_n_steps=1", "logging.progress_bar=false", "logging.trackers=[]")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(proc: subprocess.CompletedProcess, fragment: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and last.endswith(".") and fragment in last, last
    return last


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_used_run_folder_is_never_clobbered(tmp_path):
    run = tmp_path / "run"
    run_app(*ARGS, f"hydra.run.dir={run}", cwd=tmp_path, check=True)
    before = snapshot(run)
    assert ".hydra/overrides.yaml" in before and LOCK_FILE not in before  # the lock goes with its run

    # A new run on it: refused before Hydra writes anything there.
    message = refused(run_app(*ARGS, f"hydra.run.dir={run}", cwd=tmp_path), "already holds a run")
    assert f"resume={run}" in message and "overwrite=true" in message
    assert snapshot(run) == before

    # A refused resume (another optimizer) leaves every file as it was, .hydra/ and app.log included.
    refused(run_app(f"resume={run}", "optim=sgd", cwd=tmp_path), "another task or optimizer configuration")
    assert snapshot(run) == before
    refused(run_app(f"resume={run}", "overwrite=true", cwd=tmp_path), "cannot be combined with resume")

    # overwrite=true: the earlier run is moved aside intact, the new one starts from nothing.
    proc = run_app(*ARGS, "trainer.max_steps=1", f"hydra.run.dir={run}", "overwrite=true", cwd=tmp_path, check=True)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert f"moved the earlier run in {run} to {aside}" in proc.stdout
    assert {k: v for k, v in snapshot(aside).items() if k != "app.log"} == {
        k: v for k, v in before.items() if k != "app.log"}
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["checkpoint_0"]
    # The accepted resume of the new run does not carry overwrite=true along.
    run_app(f"resume={run}", "trainer.max_steps=2", cwd=tmp_path, check=True)
    assert "overwrite" not in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.timeout(200)
def test_a_start_refused_once_training_runs_leaves_nothing_and_the_retry_runs(tmp_path):
    """A refusal that comes after the trackers opened ``metrics.jsonl`` and ``tensorboard/`` (a rule only
    the first step can check: APP_FAIL_MODE=refuse stands for it) takes them back with the folder, so the
    same command into the same folder is a new run, not "already holds a run"."""
    run = tmp_path / "run"
    args = (*ARGS, "logging.trackers=[tensorboard]", f"hydra.run.dir={run}")
    refused(run_app(*args, cwd=tmp_path, env={"APP_FAIL_AT_STEP": "1", "APP_FAIL_MODE": "refuse"}),
            "injected refusal on rank 0 at step 1")
    assert not run.exists()
    run_app(*args, cwd=tmp_path, check=True)
    assert (run / "tensorboard").is_dir() and json.loads((run / "result.json").read_text())["steps"] == 2
    # A run that ended before its first checkpoint (a crash) keeps its folder; resume= is not offered for it.
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "metrics.jsonl").write_text('{"step": 1}\n')
    message = refused(run_app(*ARGS, f"hydra.run.dir={tmp_path / 'crashed'}", cwd=tmp_path), "already holds a run")
    assert "it has no checkpoint to resume; choose a new folder, or pass overwrite=true" in message, message


@pytest.mark.signals
@pytest.mark.timeout(200)
def test_a_live_run_holds_its_folder_and_a_killed_one_lets_go(tmp_path):
    run = tmp_path / "run"
    # No early stopping: the checks below need the run alive (it is killed at the end).
    first = subprocess.Popen([sys.executable, "-m", "app", "trainer.max_epochs=200", "checkpoint.every_n_steps=5",
                              "early_stopping.patience=null", "logging.progress_bar=false", "logging.trackers=[]",
                              f"hydra.run.dir={run}"],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # The first run is training and has saved a checkpoint (any: rotation soon removes checkpoint_0).
        while not list(run.glob("checkpoints/checkpoint_*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None
        holder = f"in use by process {first.pid} on host {socket.gethostname()}"
        for args in ([f"hydra.run.dir={run}", "resume=auto"], [f"resume={run}"]):
            refused(run_app(*args, *ARGS, cwd=tmp_path, timeout=60), holder)
        with pytest.raises(RunFolderError, match=holder):
            RunFolderLock.acquire(run)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # The killed run's lock file stays behind with its pid; the kernel released the lock itself.
    assert (run / LOCK_FILE).read_text().split()[0] == str(first.pid)
    lock = RunFolderLock.acquire(run)
    assert (run / LOCK_FILE).read_text().split()[0] != str(first.pid)
    with pytest.raises(RunFolderError, match="in use by process"):
        RunFolderLock.acquire(run)  # one holder at a time, also within a process
    lock.release()
    assert not (run / LOCK_FILE).exists()


def test_printing_the_config_claims_no_folder(tmp_path, monkeypatch):
    from app.cli.argv import claim_from_argv

    monkeypatch.chdir(tmp_path)
    argv = ["--cfg", "job", "hydra.run.dir=somewhere"]
    assert claim_from_argv(argv) == argv and not (tmp_path / "somewhere").exists()
