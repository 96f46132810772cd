"""The application on 2 real processes: the same results as 1 process, one run folder however it is
launched (python -m app, torchrun, two torchrun "nodes", a multirun sweep), and a failing rank ends
the run promptly with its error shown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from app.launching.launch import launch
from app.workers.elastic import WorkerFailed, free_port
from tests.conftest import compose_many, run_app
from tests.helpers.distributed_helpers import ddp_backend, on_processes

pytestmark = [pytest.mark.multiprocess]

QUICK = ["trainer.max_epochs=2", "logging.trackers=[]", "logging.progress_bar=false",
         "checkpoint.save_final_model=false"]


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_folders(root: Path) -> list[Path]:
    """Folders with Hydra's .hydra/ (one per run or sweep job), anywhere under root."""
    return sorted(p.parent for p in root.rglob(".hydra"))


@pytest.mark.timeout(180)
def test_two_processes_evaluate_and_stop_like_one(tmp_path: Path) -> None:
    # Without dropout and within the first epoch (22 full global batches of 64), 2 processes x 32
    # train exactly like 1 x 64; evaluation on 2 processes must then report the same metrics, and
    # early stopping must stop both at the same evaluation (step 12 with these settings).
    common = ["task.dropout=0", "optim.lr=0.01", "scheduler=constant", "trainer.max_steps=22",
              "trainer.eval_every_n_steps=2", "trainer.log_every_n_steps=2", "early_stopping.patience=2",
              "early_stopping.min_delta=0.02", *QUICK]
    one, two = compose_many([[*common, "trainer.batch_size=64"],
                             [*common, "trainer.batch_size=32", "hardware=multi_cpu", "hardware.num_processes=2"]])
    best_one = launch(one, tmp_path / "one")
    best_two = launch(two, tmp_path / "two")
    assert best_two == pytest.approx(best_one)
    evals = {name: [r for r in _records(tmp_path / name) if "eval/accuracy" in r] for name in ("one", "two")}
    assert [r["step"] for r in evals["one"]] == [r["step"] for r in evals["two"]]
    assert evals["one"][-1]["step"] < 22  # early stopping, not max_steps, ended both runs
    for a, b in zip(evals["one"], evals["two"]):
        assert b["eval/accuracy"] == a["eval/accuracy"]
        assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-4)
        assert b["eval/f1"] == pytest.approx(a["eval/f1"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_python_m_app_trains_on_two_processes_with_one_folder_bar_and_log(tmp_path: Path) -> None:
    proc = run_app("hardware=multi_cpu", "hardware.num_processes=2", cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run_dir] = _run_folders(tmp_path)
    assert [p.name for p in run_dir.rglob("metrics.jsonl")] == ["metrics.jsonl"]
    best = max(r["eval/accuracy"] for r in _records(run_dir) if "eval/accuracy" in r)
    assert best >= 0.95
    # Output captured through a pipe: no bar is drawn, training progress is plain log lines, each
    # step's once, all from rank 0 (a terminal's bars are tests/test_terminal.py's).
    steps = [int(s) for s in re.findall(r"\[INFO\] - train: (\d+)/\d+ steps", proc.stdout)]
    assert len(steps) >= 5 and steps == sorted(set(steps)), proc.stdout[-3000:]
    assert "\r" not in proc.stdout + proc.stderr
    log = (run_dir / "app.log").read_text()
    assert log.count("training digits on 2 process(es);") == 1 and log.count("hardware multi_cpu on cpu") == 1
    assert len(list(run_dir.rglob("events.out.tfevents*"))) == 1  # the tracker runs on rank 0 only


@pytest.mark.timeout(180)
def test_a_rank_that_raises_mid_training_fails_the_run_promptly(tmp_path: Path) -> None:
    # A hang would last at least the collective timeout (300 s here); elastic must stop rank 0 first.
    proc = run_app("hardware=multi_cpu", "hardware.num_processes=2", "hardware.collective_timeout_s=300",
                   *QUICK, cwd=tmp_path, timeout=170, env={"APP_FAIL_AT_STEP": "5", "APP_FAIL_RANK": "1"})
    exited = datetime.now()
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: rank 1 failed: InjectedFault: injected fault on rank 1 at step 5 (APP_FAIL_AT_STEP=5)"
    assert "Traceback" in proc.stderr  # the failing rank's traceback is shown above it
    # Step 5 comes well under a second after training starts: time the failure from there (process
    # start-up depends on the machine's load, not on us).
    [run_dir] = _run_folders(tmp_path)
    started = re.search(r"^\[([\d-]+ [\d:]+),\d+\].*training digits", (run_dir / "app.log").read_text(), re.MULTILINE)
    assert started is not None
    assert (exited - datetime.strptime(started.group(1), "%Y-%m-%d %H:%M:%S")).total_seconds() < 60


def dying_worker() -> None:
    backend = ddp_backend()
    backend.barrier()
    if backend.process_index == 1:
        os._exit(3)  # dies without a Python exception, as on a crash or OOM kill
    backend.barrier()  # rank 0 waits for a peer that is gone


@pytest.mark.timeout(120)
def test_a_rank_that_dies_is_reported_and_its_peer_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="^rank 1 failed: exited with code 3"):
        on_processes(dying_worker)
    assert time.monotonic() - start < 60


def _torchrun(nnodes: int, nproc: int, endpoint: str, args: list[str], cwd: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test",
               "-m", "app", *args]
    # OMP_NUM_THREADS=1: two "nodes" share this machine's cores (torchrun sets it only for nproc > 1).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _torchrun_run(tmp_path: Path, start: Any) -> Path:
    """Launch with ``start(folder)`` and check the run. A rank that aborts (SIGABRT, a crash inside a
    native library) was seen once in about ten launches on 2026-11-30, cause not yet found: the whole
    crash report is kept as a warning (pytest's summary shows it) and the launch is retried once, in
    a fresh folder. Any other failure, or a second abort, fails the test."""
    for attempt in range(2):
        folder = tmp_path / f"attempt_{attempt}"
        folder.mkdir()
        procs = start(folder)
        outputs = [p.communicate(timeout=200) for p in procs]
        aborted = any(p.returncode != 0 and "(SIGABRT)" in err for p, (_, err) in zip(procs, outputs))
        if aborted and attempt == 0:
            warnings.warn("a torchrun rank aborted (SIGABRT); retrying once. Its output:\n"
                          + "\n".join(err for _, err in outputs), stacklevel=1)
            continue
        return _assert_one_run(folder, procs, outputs)
    raise AssertionError("unreachable")


def _assert_one_run(tmp_path: Path, procs: list[subprocess.Popen[str]], outputs: list[tuple[str, str]]) -> Path:
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    [run_dir] = _run_folders(tmp_path)
    assert list(tmp_path.rglob("metrics.jsonl")) == [run_dir / "metrics.jsonl"]
    assert list(tmp_path.rglob("*.log")) == [run_dir / "app.log"]
    log = (run_dir / "app.log").read_text()
    assert log.count("training digits on 2 process(es);") == 1 and log.count("hardware multi_cpu on cpu") == 1
    assert any("eval/accuracy" in r for r in _records(run_dir))
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_two_nodes_on_localhost_share_one_run_folder(tmp_path: Path) -> None:
    args = ["hardware=multi_cpu", "hardware.num_processes=1", "hardware.num_nodes=2", *QUICK]
    def start(folder: Path) -> list[subprocess.Popen[str]]:
        endpoint = f"localhost:{free_port()}"
        return [_torchrun(2, 1, endpoint, args, folder) for _ in range(2)]

    _torchrun_run(tmp_path, start)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_two_processes_share_one_run_folder(tmp_path: Path) -> None:
    args = ["hardware=multi_cpu", "hardware.num_processes=2", *QUICK]
    _torchrun_run(tmp_path, lambda folder: [_torchrun(1, 2, f"localhost:{free_port()}", args, folder)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun_with_two_processes_gives_one_folder_per_job(tmp_path: Path) -> None:
    proc = run_app("-m", "hardware=multi_cpu", "hardware.num_processes=2", "optim.lr=1e-3,3e-3",
                   "trainer.max_steps=5", *QUICK, cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = _run_folders(tmp_path)
    assert [p.name for p in jobs] == ["0", "1"]
    assert len(list(tmp_path.rglob("metrics.jsonl"))) == 2
    for job, lr in zip(jobs, ("0.001", "0.003")):
        assert f"optim.lr={lr}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert (job / "metrics.jsonl").exists()
