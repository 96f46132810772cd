"""SLURM for real, on a cluster started on this machine for the session (``tests/helpers/slurm_cluster.py``:
munged, slurmctld, two slurmd; accounting off): a sweep of two-task jobs with its report, a failing
task that ends the sweep with its sentence, ``scontrol requeue`` and ``scancel --signal=USR1`` of a
running job that saves at the step, requeues and continues by itself to the uninterrupted run's
weights, the time-limit requeue limit, and docs/slurm.md's plain ``sbatch`` script on one node and on two.

Where SLURM cannot run (not installed, not root) every test here skips, saying why. A run is held at a
known step by the fault point (``APP_FAIL_MODE=hold``: rank 0 waits there until a stop signal has
arrived), so each signal reaches a run that is training and cannot have passed that step, whenever
SLURM delivers it: no timing decides a result.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.distributed.checkpoint.store import complete_checkpoints
from tests.conftest import run_app
from tests.helpers.slurm_cluster import SlurmCluster, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ON_SLURM = ("-m", "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
            "hydra.launcher.poll_s=0.5")
TWO_TASKS = ("hardware=multi_cpu", "hardware.num_processes=2")
TINY = ("trainer.max_steps=10", "trainer.eval_every_n_steps=5", "trainer.log_every_n_steps=5",
        "logging.progress_bar=false", "logging.trackers=[]", "logging.print_config=false")
# A run whose every step is logged and that saves only when stopped (periodic checkpoints off).
STEPS = 30
LOGGED = (f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "early_stopping.patience=null",
          "checkpoint.every_epoch=false", "logging.progress_bar=false", "logging.trackers=[]",
          "logging.print_config=false")


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        cluster = SlurmCluster.start()
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        pytest.skip(f"a SLURM cluster could not be started here: {err}")
    yield cluster
    cluster.stop()
    cluster.remove()


def slurm_env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    return {"SLURM_CONF": str(cluster.conf), **extra}


def job_output(sweep: Path, job: int = 0) -> tuple[str, str, str]:
    """A sweep job's SLURM job id and its output (stdout, stderr)."""
    out = next((sweep / ".slurm").glob(f"{job}_*.out"))
    return out.stem.split("_")[1], out.read_text(), out.with_suffix(".err").read_text()


def train_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "train/loss" in line]


def weights(run: Path) -> bytes:
    return (run / "model" / "model.safetensors").read_bytes()


def wait_for_hold(sweep: Path, step: int, proc: subprocess.Popen[str], timeout: float = 200) -> str:
    """Until the sweep's job 0 is held at ``step`` (its rank 0 waits there for a stop signal: the fault
    point's ``APP_FAIL_MODE=hold``); returns the job's SLURM id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        outputs = list((sweep / ".slurm").glob("0_*.out"))
        if outputs and f"waits at step {step} for a stop signal" in outputs[0].read_text():
            return outputs[0].stem.split("_")[1]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"job 0 of {sweep} was not held at step {step}:\n{proc.communicate()[0][-3000:]}")


def start_sweep(cluster: SlurmCluster, cwd: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **slurm_env(cluster, **env)}
    return subprocess.Popen([sys.executable, "-m", "app", *ON_SLURM, *args], cwd=cwd, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def saved_at(output: str, sig: str) -> int:
    found = re.search(rf"interrupted \({sig}\) at step (\d+); resume with: python -m app resume=", output)
    assert found, output[-3000:]
    return int(found.group(1))


@pytest.mark.timeout(300)
def test_a_sweep_of_two_jobs_of_two_tasks_each_ends_with_its_report(slurm: SlurmCluster, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app(*ON_SLURM, *TWO_TASKS, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path,
                   env=slurm_env(slurm), timeout=280)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "sacct" not in said  # accounting is off: the sweep never asks it
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1"]
    for job in (0, 1):
        run = sweep / str(job)
        assert train_steps(run) == [5, 10]  # one run folder per job, written once (by rank 0)
        assert complete_checkpoints(run / "checkpoints")[-1][1].world_size == 2
        _, out, err = job_output(sweep, job)
        assert "0: " in out and "training digits on 2 process(es)" in out, out[-2000:] + err[-2000:]
        assert "in use by" not in out + err  # rank 1 never tried the run folder's lock
    with (sweep / "sweep.csv").open(newline="") as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["finished", "finished"]
    assert "**Best: job" in (sweep / "sweep.md").read_text()


@pytest.mark.timeout(300)
def test_a_failing_task_ends_the_sweep_with_its_sentence(slurm: SlurmCluster, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app(*ON_SLURM, *TWO_TASKS, f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path, timeout=280,
                   env=slurm_env(slurm, APP_FAIL_AT_STEP="2", APP_FAIL_RANK="1"))
    ended = time.time()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id, out, _ = job_output(sweep)
    sentence = (f"job 0 (SLURM job {job_id}) failed: rank 1 failed: InjectedFault: injected fault on rank 1 at "
                "step 2 (APP_FAIL_AT_STEP=2)")
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {sentence}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "sacct" not in proc.stdout + proc.stderr
    # The sweep ended soon after the task failed (at step 2): rank 0's "training" line is the mark.
    training = re.search(r"^0: \[([\d-]+ [\d:]+),\d+\]\[app.engine.run\]\[INFO\] - training digits", out, re.MULTILINE)
    assert training, out[-3000:]
    assert ended - time.mktime(time.strptime(training.group(1), "%Y-%m-%d %H:%M:%S")) < 60


@pytest.mark.signals
@pytest.mark.timeout(400)
def test_scontrol_requeue_then_scancel_usr1_save_requeue_and_resume_by_themselves(slurm: SlurmCluster,
                                                                                   tmp_path: Path) -> None:
    # Held at step 3 (scontrol requeue: SLURM requeues the job) and at step 15 (SIGUSR1, the time-limit
    # warning: the job requeues itself, once: max_num_timeout=1); then it runs to the end by itself.
    sweep, reference = tmp_path / "sweep", tmp_path / "reference"
    run = sweep / "0"
    proc = start_sweep(slurm, tmp_path, *TWO_TASKS, *LOGGED, "hydra.launcher.max_num_timeout=1",
                       f"hydra.sweep.dir={sweep}", APP_FAIL_MODE="hold", APP_FAIL_AT_STEP="3,15")
    job_id = wait_for_hold(sweep, 3, proc)
    slurm.run("scontrol", "requeue", job_id)
    # The uninterrupted run, on two local processes, while SLURM waits to start the job again.
    uninterrupted = subprocess.Popen([sys.executable, "-m", "app", *TWO_TASKS, *LOGGED, f"hydra.run.dir={reference}"],
                                     cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_hold(sweep, 15, proc)
    slurm.run("scancel", "--signal=USR1", job_id)
    said = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, said[-3000:]
    assert uninterrupted.wait(timeout=200) == 0, uninterrupted.communicate()[1][-3000:]

    out = job_output(sweep)[1]
    on_term, on_usr1 = saved_at(out, "SIGTERM"), saved_at(out, "SIGUSR1")
    assert (on_term, on_usr1) == (4, 16)  # the step after the held one: the ranks agree one step late
    assert f"resumed from {run / 'checkpoints'}" in out and f"(step {on_term}, epoch 0)" in out
    assert f"(step {on_usr1}, epoch 0)" in out
    assert f"SLURM job {job_id} requeued itself (1 of 1)" in out
    assert re.search(r"Restarts=2\b", slurm.run("scontrol", "show", "job", job_id).stdout)
    assert "pending" in said and "completed" in said and "sacct" not in said
    assert train_steps(run) == list(range(1, STEPS + 1))  # each step once: the log was cut back at resume
    assert weights(run) == weights(reference)


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_past_max_num_timeout_the_job_ends_with_its_checkpoint_and_the_resume_command(slurm: SlurmCluster,
                                                                                     tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = sweep / "0"
    proc = start_sweep(slurm, tmp_path, *TWO_TASKS, *LOGGED, "hydra.launcher.max_num_timeout=0",
                       f"hydra.sweep.dir={sweep}", APP_FAIL_MODE="hold", APP_FAIL_AT_STEP="3")
    job_id = wait_for_hold(sweep, 3, proc)
    slurm.run("scancel", "--signal=USR1", job_id)
    said = proc.communicate(timeout=200)[0]
    assert proc.returncode == 1, said[-3000:]
    _, out, err = job_output(sweep)
    step = saved_at(out, "SIGUSR1")
    assert step == 4
    assert complete_checkpoints(run / "checkpoints")[-1][1].step == step
    assert f"SLURM job {job_id} is not requeued again" in out + err
    assert (f"job 0 (SLURM job {job_id}) failed: interrupted (SIGUSR1) at step {step}; resume with: "
            f"python -m app resume={run}") in said
    assert re.search(r"Restarts=0\b", slurm.run("scontrol", "show", "job", job_id).stdout)


@pytest.mark.timeout(120)
def test_a_sweep_that_sbatch_refuses_stops_in_one_sentence(slurm: SlurmCluster, tmp_path: Path) -> None:
    # A partition the cluster does not have.
    sweep = tmp_path / "sweep"
    refused = run_app(*ON_SLURM, "hydra.launcher.partition=nowhere", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}",
                      *TINY, cwd=tmp_path, env=slurm_env(slurm), timeout=100)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: sbatch refused {sweep / '.slurm' / '0.sbatch'}: ") and "partition" in last, last
    assert not slurm.run("squeue", "-h", "-o", "%i").stdout.strip()  # nothing left queued


@pytest.mark.timeout(120)
def test_a_slurm_sweep_without_slurm_here_stops_in_one_sentence(tmp_path: Path) -> None:
    no_slurm = run_app(*ON_SLURM, f"hydra.sweep.dir={tmp_path / 'other'}", *TINY, cwd=tmp_path, timeout=100,
                       env={"PATH": str(Path(sys.executable).parent)})
    assert no_slurm.returncode == 2, no_slurm.stderr[-3000:]
    assert no_slurm.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=slurm needs SLURM's sbatch, which is not on PATH: run the sweep on a machine of "
        "the cluster (a login node).")


# The batch script of docs/slurm.md, with this machine's interpreter and the test's layout.
README_SCRIPT = """#!/bin/bash
#SBATCH --requeue --signal=USR1@120 --open-mode=append
#SBATCH --output={folder}/%j.out --error={folder}/%j.err
srun --label --kill-on-bad-exit=1 {python} -m app hardware=multi_cpu {layout} \\
    hydra.run.dir={folder}/job-$SLURM_JOB_ID {tiny}
"""


@pytest.mark.timeout(300)
def test_the_readme_sbatch_script_runs_four_ranks_on_two_nodes_and_on_one(slurm: SlurmCluster, tmp_path: Path) -> None:
    if len(slurm.nodes) < 2:
        pytest.skip("this machine is named localhost: the cluster has no second node")
    layouts = {  # sbatch options, the app's layout; 4 tasks on a 2-core machine: --overcommit
        "two_nodes": (["--partition=two_nodes", "--nodes=2", "--ntasks-per-node=2"],
                      "hardware.num_nodes=2 hardware.num_processes=2"),
        "one_node": (["--nodes=1", "--ntasks=4"], "hardware.num_processes=4"),
    }
    tiny = "trainer.max_steps=4 trainer.log_every_n_steps=2 logging.progress_bar=false logging.trackers=[]"
    jobs = {}
    for name, (options, layout) in layouts.items():
        folder = tmp_path / name
        folder.mkdir()
        script = folder / "job.sbatch"
        script.write_text(README_SCRIPT.format(folder=folder, python=sys.executable, layout=layout, tiny=tiny))
        submitted = slurm.run("sbatch", "--parsable", "--overcommit", *options, str(script))
        jobs[name] = (folder, submitted.stdout.strip())
    deadline = time.monotonic() + 250
    while slurm.run("squeue", "-h", "-o", "%i").stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    ended = {}
    for name, (folder, job_id) in jobs.items():
        out, err = (folder / f"{job_id}.out").read_text(), (folder / f"{job_id}.err").read_text()
        ended[name] = (slurm.run("scontrol", "show", "job", job_id).stdout, out, err, folder / f"job-{job_id}")

    # Two nodes of two tasks: ranks 0-3, two per node (LOCAL_WORLD_SIZE 2, node ranks 0 and 1).
    shown, out, err, run = ended["two_nodes"]
    assert "JobState=COMPLETED" in shown, out[-2000:] + err[-2000:]
    assert re.search(r"NumNodes=2\b", shown) and re.search(r"\bNodeList=\S*localhost", shown), shown
    assert "training digits on 4 process(es)" in out
    assert complete_checkpoints(run / "checkpoints")[-1][1].world_size == 4
    assert train_steps(run) == [2, 4]
    shown, out, err, one_node = ended["one_node"]
    if (os.cpu_count() or 1) >= 4:
        # Four ranks see the same data shards either way: the same weights, bit for bit.
        assert "JobState=COMPLETED" in shown, out[-2000:] + err[-2000:]
        assert weights(one_node) == weights(run)
    else:
        # One node of four tasks on fewer cores: the app refuses the layout in one sentence.
        assert "JobState=FAILED" in shown
        assert re.search(r"^\d: error: hardware.num_processes=4 asks for more CPU processes than the \d core",
                         err, re.MULTILINE), err[-2000:]
