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

TINY = ("trainer.max_steps=10", "trainer.eval_every_n_steps=5", "trainer.log_every_n_steps=5",
        "logging.progress_bar=false", "logging.trackers=[]")


def read_csv(sweep: Path) -> list[dict[str, str]]:
    with (sweep / "sweep.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.report", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grid_sweep_report_ranks_jobs_and_a_nan_job_never_wins(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # lr 1e30 without clipping: the loss is NaN by the first log line.
    run_app("-m", "optim=sgd", "optim.lr=0.1,1e30", "trainer.max_grad_norm=null", f"hydra.sweep.dir={sweep}",
            *TINY, cwd=tmp_path, check=True)
    rows = read_csv(sweep)
    assert [(r["job"], r["status"], r["folder"]) for r in rows] == [("0", "finished", "0"), ("1", "nan", "1")]
    assert rows[0]["overrides"].startswith("optim=sgd optim.lr=0.1 ")
    assert rows[0]["steps"] == "10" and rows[0]["best_step"] in ("5", "10")
    assert float(rows[0]["best"]) == float(rows[0]["final/eval/accuracy"]) or rows[0]["best_step"] == "5"
    result = yaml.safe_load((sweep / "1" / "result.json").read_text())
    assert result["status"] == "nan" and result["objective"] is None
    markdown = (sweep / "sweep.md").read_text()
    assert "**Best: job 0** (optim.lr=0.1)" in markdown
    assert markdown.index("| 1 ★ | 0 |") < markdown.index("| 2 | 1 |")
    assert (sweep / "sweep.png").stat().st_size > 10_000

    # python -m app.report rebuilds the same report, and plots a single run.
    before = (sweep / "sweep.csv").read_text()
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        (sweep / name).unlink()
    assert report(str(sweep), cwd=tmp_path).returncode == 0
    assert (sweep / "sweep.csv").read_text() == before and (sweep / "sweep.png").exists()
    assert report(str(sweep / "0"), cwd=tmp_path).returncode == 0
    assert (sweep / "0" / "report.png").exists()
    refused = report(str(tmp_path / "nothing"), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_optuna_search_on_parallel_jobs_reports_the_best_trial_and_continues_its_study(tmp_path: Path) -> None:
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

    # A larger n_trials continues the stored study: one more trial, in its own folder (this time on
    # Hydra's default launcher).
    run_app(*args, "hydra.sweeper.n_trials=3", cwd=tmp_path, timeout=200, check=True)
    study = optuna.load_study(study_name="app", storage=f"sqlite:///{sweep}/optuna.db")
    assert [t.number for t in study.trials] == [0, 1, 2]
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert [r["job"] for r in read_csv(sweep)] == ["0", "1", "2"]
    params = study.trials[2].params
    overrides = (sweep / "2" / ".hydra" / "overrides.yaml").read_text()
    assert f"optim.lr={params['optim.lr']}" in overrides


def test_a_failed_or_nan_job_is_a_failed_optuna_trial(tmp_path: Path) -> None:
    # What the search is told about each job (app/sweeps/optuna_search.py), against a real study.
    import optuna
    from hydra.core.utils import JobReturn, JobStatus

    from app.sweeps.optuna_search import OptunaSearch

    search = OptunaSearch(sampler=None, direction="max", storage=None, study_name=None, n_trials=3, n_jobs=3,
                          max_failure_rate=1.0, search_space=None, custom_search_space=None, params=None)
    study = optuna.create_study(directions=search._get_directions())
    trials = [study.ask() for _ in range(3)]
    returns = [JobReturn(status=JobStatus.COMPLETED, _return_value=0.5),
               JobReturn(status=JobStatus.COMPLETED, _return_value=math.nan),
               JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"))]
    search._tell(study, [t.number for t in trials], returns)
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.FAIL]
    assert study.best_value == 0.5

    strict = OptunaSearch(sampler=None, direction="min", storage=None, study_name=None, n_trials=1, n_jobs=1,
                          max_failure_rate=0.0, search_space=None, custom_search_space=None, params=None)
    assert strict._get_directions() == ["minimize"]
    study = optuna.create_study(directions=strict._get_directions())
    with pytest.raises(RuntimeError, match="max_failure_rate"):
        strict._tell(study, [study.ask().number], returns[2:])


def test_sweep_configs_compose(tmp_path: Path) -> None:
    proc = run_app("hparams_search=mrpc_optuna", "hydra/launcher=slurm", "hardware=multi_cpu", "--cfg", "all",
                   "--resolve", cwd=tmp_path, timeout=60, check=True)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["task"]["name"] == "glue_mrpc" and cfg["early_stopping"]["monitor"] == "eval/f1"
    sweeper, launcher = cfg["hydra"]["sweeper"], cfg["hydra"]["launcher"]
    assert sweeper["direction"] == "max" and sweeper["storage"].endswith("/optuna.db")
    assert launcher["tasks_per_node"] == 2 and launcher["max_num_timeout"] > 0
    assert REPO.joinpath("conf", "hparams_search", "digits_optuna.yaml").exists()
