"""Our Optuna sweeper (``hydra/sweeper=optuna``, ``app/sweeps``): Hydra's sweep syntax into Optuna's
distributions, samplers by name, the pruner's warm-up, the study link a job inherits, settings refused
in one sentence; and, as a user runs it, a pruned sweep that stops its bad trial (on one process and on
two), is killed, and resumes with the same command without running a finished or pruned trial again."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from app.config import ConfigError
from app.sweeps.optuna_config import PrunerName, SamplerName
from app.sweeps.optuna_objects import build_pruner, build_sampler
from app.sweeps.search_space import parse_search_space
from app.sweeps.study_link import STUDY_ENV, StudyLink, StudyLinkError, exported
from tests.conftest import run_app
from tests.test_sweeps import files, kill_sweep_during_job, read_csv

optuna.logging.set_verbosity(optuna.logging.WARNING)

QUIET = ("logging.progress_bar=false", "logging.trackers=[]", "logging.print_config=false")
# The search of conf/hparams_search/digits_optuna.yaml narrowed to optim.lr (the others fixed), so that
# trials enqueued in the study (study.enqueue_trial) decide every trial's parameters.
PRUNED_SEARCH = ("-m", "hparams_search=digits_optuna", "hydra.sweeper.n_jobs=1", "hydra.sweeper.pruner=median",
                 "hydra.sweeper.pruner_startup_trials=1", "hydra.sweeper.pruner_warmup_evaluations=0",
                 "optim.lr=tag(log, interval(1e-8, 1e-1))", "optim.weight_decay=0.01", "task.dropout=0.1",
                 "trainer.batch_size=32", "trainer.eval_every_n_steps=10", "trainer.log_every_n_steps=5",
                 "early_stopping.patience=null", "resume=auto", *QUIET)
GOOD, BAD = 1e-2, 1e-7
"""Learning rates: after 10 steps, about 0.4 and 0.13 (chance) eval/accuracy on digits."""


def study_with(sweep: Path, *learning_rates: float, direction: str = "maximize") -> str:
    """The sweep folder's study, made in advance with these trials enqueued; returns its storage URL."""
    sweep.mkdir(parents=True)
    storage = f"sqlite:///{sweep}/optuna.db"
    study = optuna.create_study(study_name="app", storage=storage, direction=direction)
    for lr in learning_rates:
        study.enqueue_trial({"optim.lr": lr})
    return storage


def trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="app", storage=storage).trials


def logged_steps(folder: Path) -> list[int]:
    return [e["step"] for e in map(yaml.safe_load, (folder / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in e]


# -- the pieces ------------------------------------------------------------------------------------------------

def test_hydra_sweep_syntax_becomes_optuna_distributions_and_overrides_again() -> None:
    space = parse_search_space(
        {"optim.lr": "tag(log, interval(3e-4, 3e-2))", "trainer.batch_size": "choice(16, 32, 64)",
         "task.dropout": "interval(0.0, 0.4)"},
        ["trainer.max_epochs=range(2, 9, 3)", "optim=choice(adamw, sgd)", "task.dropout=0.2", "+seed_note='a b'",
         'task.name=choice("x y", z)'])
    assert space.distributions == {
        "optim.lr": FloatDistribution(3e-4, 3e-2, log=True), "trainer.batch_size": CategoricalDistribution([16, 32, 64]),
        "trainer.max_epochs": IntDistribution(2, 8, step=3), "optim": CategoricalDistribution(["adamw", "sgd"]),
        "task.name": CategoricalDistribution(["x y", "z"])}
    assert space.fixed == ["task.dropout=0.2", "+seed_note='a b'"]  # the command line's value wins over the config's
    params = {"optim.lr": 0.001, "trainer.batch_size": 64, "trainer.max_epochs": 5, "optim": "sgd", "task.name": "x y"}
    overrides = space.overrides(params)
    assert overrides == ["optim.lr=0.001", "trainer.batch_size=64", "trainer.max_epochs=5", "optim=sgd",
                         "task.name=x\\ y", "task.dropout=0.2", "+seed_note='a b'"]
    # What Hydra reads back from each trial's overrides is the trial's parameter.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    read = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides[:5])}
    assert read == params

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    space.suggest(trial)
    assert set(trial.params) == set(space.distributions) and trial.params["trainer.max_epochs"] in (2, 5, 8)

    assert parse_search_space({"a": "choice(1, 2)", "b": "range(0.1, 0.35, 0.1)"}, []).grid() == {
        "a": [1, 2], "b": [0.1, 0.2, 0.3]}
    for params, message in [({"optim.lr": "interval(1e-4, 1e-2)"}, "sampler=grid needs a finite set of values for optim.lr"),
                            ({"x": "tag(int, interval(1, 2))"}, "knows the tag log only"),
                            ({"x": "tag(log, interval(0, 2))"}, "not positive"),
                            ({"x": "interval(1"}, "cannot parse the sweep override 'x=interval(1'")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            parse_search_space(params, []).grid()


@pytest.mark.parametrize("name", list(SamplerName))
def test_each_sampler_asks_the_same_trials_for_the_same_seed(name: SamplerName) -> None:
    lr = "choice(1e-4, 1e-3, 1e-2, 1e-1)" if name is SamplerName.grid else "tag(log, interval(1e-4, 1e-1))"
    space = parse_search_space({"lr": lr, "layers": "range(1, 4)", "act": "choice(relu, gelu)"}, [])

    def asked(seed: int) -> list[dict[str, object]]:
        study = optuna.create_study(sampler=build_sampler(name, seed, space), direction="maximize")
        for _ in range(4):
            trial = study.ask()
            space.suggest(trial)
            study.tell(trial, -abs(math.log10(trial.params["lr"]) + 2))  # best at lr 1e-2
        return [t.params for t in study.trials]

    first = asked(7)
    assert first == asked(7) and first != asked(8)
    if name is SamplerName.grid:  # told its last trial, Optuna's grid sampler would stop the study: only optimize() may
        space = parse_search_space({"lr": "choice(1e-3, 1e-2)"}, [])
        study = optuna.create_study(sampler=build_sampler(name, 7, space))
        for _ in range(2):
            trial = study.ask()
            space.suggest(trial)
            study.tell(trial, 1.0)
        assert sorted(t.params["lr"] for t in study.trials) == [1e-3, 1e-2]


def test_a_sampler_without_its_package_is_refused_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cmaes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.sampler=cmaes needs the cmaes package \(pip install cmaes\), "
                                          r"which is not installed.$"):
        build_sampler(SamplerName.cmaes, 0, parse_search_space({"x": "interval(0, 1)"}, []))


def test_the_median_pruner_waits_for_its_warm_up_and_startup_trials() -> None:
    study = optuna.create_study(direction="maximize", pruner=build_pruner(PrunerName.median, warmup_evaluations=2,
                                                                           startup_trials=1))
    good = study.ask()
    for evaluation in (1, 2, 3):
        good.report(0.9, evaluation)
    bad = study.ask()
    bad.report(0.1, 1)
    assert not bad.should_prune()  # no trial completed yet
    study.tell(good, 0.9)
    bad.report(0.1, 2)
    assert not bad.should_prune()  # evaluation 2: still warming up
    bad.report(0.1, 3)
    assert bad.should_prune()
    assert not isinstance(build_pruner(PrunerName.hyperband, 2, 5), optuna.pruners.NopPruner)
    assert isinstance(build_pruner(PrunerName.none, 2, 5), optuna.pruners.NopPruner)


def test_the_study_link_a_job_inherits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from app.engine.pruning import NoPruning
    from app.sweeps.trial_pruning import build_pruning
    from tests.conftest import compose_config

    link = StudyLink(storage=f"sqlite:///{tmp_path}/missing/optuna.db", study_name="app", pruner=PrunerName.median,
                     warmup_evaluations=2, startup_trials=5)
    environ: dict[str, str] = {STUDY_ENV: "before"}
    with exported(link, environ):
        assert StudyLink.from_env(environ) == link
    assert environ == {STUDY_ENV: "before"}  # as it was
    with pytest.raises(StudyLinkError, match=f"^{STUDY_ENV}='before' is not what the Optuna sweeper writes"):
        StudyLink.from_env(environ)
    assert StudyLink.from_env({}) is None
    # Only the main process talks to the study: another one never opens the storage (that one would fail).
    cfg = compose_config()
    with exported(link):
        assert isinstance(build_pruning(cfg, tmp_path, is_main_process=False), NoPruning)
    assert isinstance(build_pruning(cfg, tmp_path, is_main_process=True), NoPruning)  # not in a sweep
    # The main process of a job whose folder no running trial has: said, and not pruned.
    link = StudyLink(storage=study_with(tmp_path / "search"), study_name="app", pruner=PrunerName.median,
                     warmup_evaluations=2, startup_trials=5)
    with exported(link), caplog.at_level(logging.WARNING):
        assert isinstance(build_pruning(cfg, tmp_path / "search" / "0", is_main_process=True), NoPruning)
    assert f"no running trial of study app has the run folder {tmp_path / 'search' / '0'}" in caplog.text


def test_the_sweep_stack_is_current() -> None:
    import sqlalchemy

    assert int(optuna.__version__.split(".")[0]) >= 4 and int(sqlalchemy.__version__.split(".")[0]) >= 2


def test_sweeper_settings_that_cannot_work_are_one_sentence(tmp_path: Path) -> None:
    sweep = tmp_path / "search"
    grid = run_app("-m", "hparams_search=digits_optuna", "hydra.sweeper.sampler=grid", f"hydra.sweep.dir={sweep}",
                   *QUIET, cwd=tmp_path, timeout=60)
    assert grid.returncode == 2
    assert grid.stderr.strip().splitlines()[-1] == (
        "error: hydra.sweeper.sampler=grid needs a finite set of values for optim.lr: give it as choice(...) or "
        "range(...), not interval(...).")
    assert not sweep.exists()
    storage = study_with(sweep, direction="minimize")
    opposite = run_app("-m", "hparams_search=digits_optuna", f"hydra.sweep.dir={sweep}", *QUIET, cwd=tmp_path, timeout=60)
    assert opposite.returncode == 2
    assert opposite.stderr.strip().splitlines()[-1] == (
        f"error: study app in {storage} was made to minimize, not to maximize (early_stopping.mode=max); use "
        "another hydra.sweeper.study_name or hydra.sweep.dir.")
    assert sorted(p.name for p in sweep.iterdir()) == ["optuna.db"]


# -- as a user runs it -----------------------------------------------------------------------------------------

@pytest.mark.signals
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pruned_sweep_stops_its_bad_trial_then_resumes_after_a_kill_without_rerunning_a_trial(tmp_path: Path) -> None:
    sweep = tmp_path / "search"
    storage = study_with(sweep, GOOD, BAD, GOOD)
    command = (*PRUNED_SEARCH, "hydra.sweeper.n_trials=3", "trainer.max_steps=30", "checkpoint.every_n_steps=5",
               f"hydra.sweep.dir={sweep}")
    kill_sweep_during_job(tmp_path, sweep / "2", *command)
    assert [t.state for t in trials(storage)] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING]

    # The bad trial stopped at its first evaluation as on an early stop: its best exported, its checkpoints kept.
    pruned = sweep / "1"
    result = yaml.safe_load((pruned / "result.json").read_text())
    assert result["status"] == "pruned" and result["steps"] == 10 and result["objective"] is None
    assert result["stop_reason"].startswith("pruned by the sweep's median pruner at evaluation 1 (step 10)")
    assert logged_steps(pruned) == [5, 10] and (pruned / "model" / "model.safetensors").exists()
    assert trials(storage)[1].user_attrs["pruned_at_step"] == 10 and trials(storage)[1].intermediate_values.keys() == {1}
    done = {job: files(sweep / job) for job in ("0", "1")}

    run_app(*command, cwd=tmp_path, timeout=200, check=True)  # the same command again
    for job, before in done.items():
        assert files(sweep / job) == before, f"job {job} was run again"
    assert "resumed from" in (sweep / "2" / "app.log").read_text()
    study = trials(storage)
    assert [t.state for t in study] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.COMPLETE]  # no new trial
    assert study[2].value == study[0].value and study[2].intermediate_values == study[0].intermediate_values

    rows = read_csv(sweep)
    assert [(r["job"], r["status"], r["steps"], r["pruned_at_step"]) for r in rows] == [
        ("0", "finished", "30", ""), ("1", "pruned", "10", "10"), ("2", "finished", "30", "")]
    markdown = (sweep / "sweep.md").read_text()
    assert "3 job(s) (2 finished, 1 pruned)" in markdown and "| pruned at step 10 |" in markdown
    assert "**Best: job 0**" in markdown
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_trial"] == 0 and results["trials"] == {"complete": 2, "pruned": 1, "fail": 0}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_pruned_two_process_trial_stops_on_both_ranks(tmp_path: Path) -> None:
    sweep = tmp_path / "search"
    storage = study_with(sweep, GOOD, BAD)
    run_app(*PRUNED_SEARCH, "hydra.sweeper.n_trials=2", "trainer.max_steps=20", "hardware=multi_cpu",
            "hardware.num_processes=2", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=280, check=True)
    assert [t.state for t in trials(storage)] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert logged_steps(sweep / "0") == [5, 10, 15, 20] and logged_steps(sweep / "1") == [5, 10]
    result = yaml.safe_load((sweep / "1" / "result.json").read_text())
    assert result["status"] == "pruned" and result["steps"] == 10
    assert [r["status"] for r in read_csv(sweep)] == ["finished", "pruned"]
