"""Sweeps as a user runs them (``python -m app -m ...``): the report at the end of every multirun,
an Optuna search on parallel jobs that continues its study, jobs of two processes under submitit,
and a killed grid sweep that resumes. Jobs are tiny digits runs."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_app
from tests.helpers.metrics_rows import metrics_rows, without_throughput

TINY = ("trainer.max_steps=10", "trainer.eval_every_n_steps=5", "trainer.log_every_n_steps=5",
        "logging.progress_bar=false", "logging.trackers=[]")


def read_csv(sweep: Path) -> list[dict[str, str]]:
    with (sweep / "sweep.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.report", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_nan_job_is_reported_as_such_and_never_wins(tmp_path: Path) -> None:
    # Two real runs in a folder laid out as Hydra lays out a sweep; lr 1e30 without clipping: the loss
    # is NaN by the first log line.
    from app.engine.run import run
    from app.report import write_sweep_report
    from tests.conftest import compose_many

    sweep = tmp_path / "sweep"
    jobs = [["optim=sgd", "optim.lr=0.1"], ["optim=sgd", "optim.lr=1e30"]]
    for number, (overrides, cfg) in enumerate(zip(jobs, compose_many(
            [[*o, "trainer.max_grad_norm=null", *TINY, "trainer.max_steps=5"] for o in jobs]))):
        (sweep / str(number) / ".hydra").mkdir(parents=True)
        (sweep / str(number) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        returned = run(cfg, sweep / str(number))
        assert math.isnan(returned) == (number == 1)
    result = yaml.safe_load((sweep / "1" / "result.json").read_text())
    assert result["status"] == "nan" and result["objective"] is None and result["steps"] == 5
    assert yaml.safe_load((sweep / "0" / "result.json").read_text())["status"] == "finished"

    write_sweep_report(sweep)
    assert [(r["job"], r["status"]) for r in read_csv(sweep)] == [("0", "finished"), ("1", "nan")]
    markdown = (sweep / "sweep.md").read_text()
    assert "**Best: job 0** (optim.lr=0.1)" in markdown
    assert markdown.index("| 1 ★ | 0 |") < markdown.index("| 2 | 1 |")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_optuna_search_on_parallel_jobs_reports_the_best_trial(tmp_path: Path) -> None:
    import optuna

    sweep = tmp_path / "search"
    args = ["-m", "hparams_search=digits_optuna", f"hydra.sweep.dir={sweep}", *TINY]
    # Two trials at once (hydra.sweeper.n_jobs=2), on two joblib workers.
    run_app(*args, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_trials=2", cwd=tmp_path,
            timeout=380, check=True)
    rows = read_csv(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert all(r["status"] == "finished" for r in rows)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = max(rows, key=lambda r: float(r["best"]))  # direction from early_stopping.mode=max
    assert results["best_value"] == float(best["best"])
    assert f"**Best: job {results['best_trial']}**" in (sweep / "sweep.md").read_text()
    assert results["best_trial"] == int(best["job"])

    study = optuna.load_study(study_name="app", storage=f"sqlite:///{sweep}/optuna.db")  # stored in the sweep
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE and len(study.trials) == 2


def test_a_failed_or_nan_job_is_a_failed_optuna_trial(tmp_path: Path) -> None:
    # What the search is told about each job (app/sweeps/optuna_search.py), against a real study.
    import optuna
    from hydra.core.utils import JobReturn, JobStatus

    from app.config import MonitorMode
    from app.sweeps.optuna_config import OptunaSweeperConfig
    from app.sweeps.optuna_search import OptunaSearch

    search = OptunaSearch(OptunaSweeperConfig(direction=MonitorMode.max, n_trials=3, n_jobs=3, max_failure_rate=1.0))
    study = optuna.create_study(direction=search.direction)
    trials = [study.ask() for _ in range(3)]
    returns = [JobReturn(status=JobStatus.COMPLETED, _return_value=0.5),
               JobReturn(status=JobStatus.COMPLETED, _return_value=math.nan),
               JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"))]
    search._tell(study, [t.number for t in trials], returns)
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.FAIL]
    assert study.best_value == 0.5

    strict = OptunaSearch(OptunaSweeperConfig(direction=MonitorMode.min, n_trials=1, n_jobs=1, max_failure_rate=0.0))
    assert strict.direction == optuna.study.StudyDirection.MINIMIZE
    study = optuna.create_study(direction=strict.direction)
    with pytest.raises(RuntimeError, match="max_failure_rate"):
        strict._tell(study, [study.ask().number], returns[2:])


def test_sweep_configs_compose(tmp_path: Path) -> None:
    proc = run_app("hparams_search=mrpc_optuna", "hydra/launcher=slurm", "hardware=multi_cpu", "--cfg", "all",
                   "--resolve", cwd=tmp_path, timeout=60, check=True)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["task"]["name"] == "glue_mrpc" and cfg["early_stopping"]["monitor"] == "eval/f1"
    sweeper, launcher = cfg["hydra"]["sweeper"], cfg["hydra"]["launcher"]
    assert sweeper["direction"] == "max" and sweeper["storage"].endswith("/optuna.db")
    # One task per process: taken from each job's hardware.num_processes (null here).
    assert launcher["_target_"] == "hydra_plugins.app_launchers.SlurmLauncher" and launcher["tasks_per_node"] is None
    assert launcher["max_num_timeout"] > 0
    assert REPO.joinpath("conf", "hparams_search", "digits_optuna.yaml").exists()


# -- resuming a killed sweep ---------------------------------------------------------------------------

GRID = ("-m", "optim.lr=1e-3,2e-3,3e-3,4e-3", "trainer.max_steps=30", "checkpoint.every_n_steps=5",
        "trainer.eval_every_n_steps=10", "trainer.log_every_n_steps=5", "early_stopping.patience=null",
        "logging.progress_bar=false", "logging.trackers=[]")


def files(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under a folder with its mtime (ns) and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def kill_sweep_during_job(cwd: Path, job: Path, *args: str) -> None:
    """SIGKILL the sweep's process group once ``job`` has a complete checkpoint (mid-job)."""
    import os
    import signal
    import time

    from app.distributed.checkpoint.store import complete_checkpoints

    proc = subprocess.Popen([sys.executable, "-m", "app", *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if (job / "checkpoints").exists() and complete_checkpoints(job / "checkpoints"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the sweep ended before its third job could be killed"


@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_grid_sweep_resumes_skipping_finished_jobs_and_ends_like_an_uninterrupted_one(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    kill_sweep_during_job(tmp_path, sweep / "2", *GRID, f"hydra.sweep.dir={sweep}")
    assert not (sweep / "2" / "result.json").exists() and not (sweep / "3").exists()
    finished = {job: files(sweep / job) for job in ("0", "1")}
    assert all("result.json" in f and "model/model.safetensors" in f for f in finished.values())

    run_app(*GRID, f"hydra.sweep.dir={sweep}", "resume=auto", cwd=tmp_path, timeout=300, check=True)
    for job, before in finished.items():
        assert files(sweep / job) == before, f"job {job} was touched"
    log = (sweep / "2" / "app.log").read_text()
    assert "resumed from" in log and "checkpoint_" in log
    rows = read_csv(sweep)
    assert [(r["job"], r["status"], r["steps"]) for r in rows] == [(str(j), "finished", "30") for j in range(4)]
    best = max(rows, key=lambda r: float(r["best"]))
    assert f"**Best: job {best['job']}**" in (sweep / "sweep.md").read_text()
    assert (sweep / "sweep.png").stat().st_size > 10_000
    steps = [e["step"] for e in map(yaml.safe_load, (sweep / "2" / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in e]
    assert steps == [5, 10, 15, 20, 25, 30]  # cut back to the checkpoint: no step twice

    # python -m app.report rebuilds the same report, and plots a single run.
    before = (sweep / "sweep.csv").read_text()
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        (sweep / name).unlink()
    assert report(str(sweep), cwd=tmp_path).returncode == 0
    assert (sweep / "sweep.csv").read_text() == before and (sweep / "sweep.png").exists()
    assert report(str(sweep / "3"), cwd=tmp_path).returncode == 0
    assert (sweep / "3" / "report.png").exists()
    refused = report(str(tmp_path / "nothing"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")

    # The interrupted job ends with the weights of the same job run without interruption.
    reference = tmp_path / "reference"
    overrides = yaml.safe_load((sweep / "2" / ".hydra" / "overrides.yaml").read_text())
    run_app(*overrides, f"hydra.run.dir={reference}", cwd=tmp_path, timeout=200, check=True)
    weights = "model/model.safetensors"
    assert (sweep / "2" / weights).read_bytes() == (reference / weights).read_bytes()

    def logged(folder: Path) -> list[dict]:  # every logged value but throughput
        return without_throughput(metrics_rows(folder))

    assert logged(sweep / "2") == logged(reference)  # so its row of the table is the uninterrupted one

    # Another grid into the same folder is refused before anything is written: resuming would continue
    # the other jobs' checkpoints with this sweep's settings.
    before = files(sweep)
    other = [a.replace("optim.lr=1e-3,2e-3,3e-3,4e-3", "optim.lr=5e-3,6e-3") for a in GRID]
    refused = run_app(*other, f"hydra.sweep.dir={sweep}", "resume=auto", cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith("error: job 0's folder")
    assert files(sweep) == before


# -- submitit and SLURM ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_submitit_runs_two_process_jobs_each_in_one_folder_with_a_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_app("-m", "hydra/launcher=submitit_local", "hardware=multi_cpu", "hardware.num_processes=2",
            "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}", *TINY, cwd=tmp_path, timeout=380, check=True)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["0", "1"]
    for job in ("0", "1"):
        assert [p.relative_to(sweep).as_posix() for p in sweep.rglob("metrics.jsonl")].count(f"{job}/metrics.jsonl") == 1
        steps = [e["step"] for e in map(yaml.safe_load, (sweep / job / "metrics.jsonl").read_text().splitlines())
                 if "train/loss" in e]
        assert steps == [5, 10]  # written once, by rank 0
    assert len(list(sweep.rglob("metrics.jsonl"))) == 2
    assert [r["status"] for r in read_csv(sweep)] == ["finished", "finished"]
    assert (sweep / "sweep.png").exists() and "**Best: job" in (sweep / "sweep.md").read_text()


def test_slurm_task_layout_and_first_host() -> None:
    from app.launching.slurm import first_host, requeued, slurm_layout

    assert first_host("gpu[07-09,12],cpu3") == "gpu07" and first_host("n1,n2") == "n1" and first_host("solo") == "solo"
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[3-4]",
           "SLURM_JOB_ID": "123456"}
    assert slurm_layout(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                 "GROUP_RANK": "1", "MASTER_ADDR": "node3", "MASTER_PORT": str(20000 + 123456 % 20000)}
    assert slurm_layout({**env, "SLURM_STEP_NUM_TASKS": "1"}) is None and slurm_layout({}) is None
    # A batch script sees SLURM_PROCID=0 and SLURM_NTASKS too, but it is one process, not a rank.
    assert slurm_layout({k: v for k, v in env.items() if k != "SLURM_STEP_NUM_TASKS"}) is None
    assert requeued({"SLURM_RESTART_COUNT": "1"}) and not requeued({})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_slurm_tasks_train_as_two_ranks_into_one_run_folder(tmp_path: Path) -> None:
    # What srun -n 2 starts: two processes that only differ in SLURM_PROCID / SLURM_LOCALID.
    import os

    from app.workers.elastic import free_port

    run = tmp_path / "run"
    base = {**os.environ, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "app", "hardware=multi_cpu", "hardware.num_processes=2",
                               f"hydra.run.dir={run}", *TINY], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "training digits on 2 process(es)" in outputs[0]  # one job of two ranks, not two jobs
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    assert yaml.safe_load((run / "result.json").read_text())["status"] == "finished"
    steps = [e["step"] for e in map(yaml.safe_load, (run / "metrics.jsonl").read_text().splitlines())
             if "train/loss" in e]
    assert steps == [5, 10]


def test_a_sweeps_jobs_share_a_wandb_group() -> None:
    from app.engine.checkpoint import tracker_kwargs

    assert tracker_kwargs(None, "outputs/multirun/x") == {"wandb": {"group": "outputs/multirun/x"}}
    assert tracker_kwargs(None) == {}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_optuna_trial_left_running_is_launched_again_under_its_number(tmp_path: Path) -> None:
    # What a killed search leaves in its study: a trial asked (RUNNING) whose job never reported.
    import optuna

    sweep = tmp_path / "search"
    sweep.mkdir()
    study = optuna.create_study(study_name="app", storage=f"sqlite:///{sweep}/optuna.db", direction="maximize")
    lr = study.ask().suggest_float("optim.lr", 1e-3, 1e-2, log=True)
    run_app("-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}",
            "resume=auto", *TINY, cwd=tmp_path, timeout=200, check=True)
    trials = optuna.load_study(study_name="app", storage=f"sqlite:///{sweep}/optuna.db").trials
    assert [(t.number, t.state) for t in trials] == [(0, optuna.trial.TrialState.COMPLETE)]  # no new trial
    assert f"optim.lr={lr}" in (sweep / "0" / ".hydra" / "overrides.yaml").read_text()
    assert trials[0].value == float(read_csv(sweep)[0]["best"])


@pytest.mark.timeout(300)
def test_the_readme_sweep_in_hydras_default_folder_ends_with_a_card_that_names_it(tmp_path: Path) -> None:
    """``python -m app -m optim.lr=...`` as the brief types it: Hydra's default sweep folder
    (``outputs/multirun/${now:...}``) is recorded unresolved in each job's ``.hydra/``; the model card
    finds the real folder (it once crashed the job listing a folder named with the interpolation)."""
    proc = run_app("-m", "trainer.max_steps=1", "optim.lr=1e-3,2e-3", "logging.trackers=[]",
                   "logging.progress_bar=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    for job in ("0", "1"):
        card = (sweep / job / "model" / "README.md").read_text()
        assert f"Job {job} of the sweep `{sweep}`" in card
    assert (sweep / "sweep.md").is_file()
