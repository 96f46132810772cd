"""hydra-optuna-sweeper's search, changed where a sweep of this app needs it:

- ``direction`` may be ``max``/``min`` (so it can interpolate ``early_stopping.mode``);
- a trial's job number is its Optuna trial number, so a continued study never puts a new trial
  in an earlier trial's folder (the plugin numbers jobs from 0 on every run);
- ``n_trials`` counts the study's trials: the same command continues an interrupted study up to
  n_trials instead of adding n_trials more; trials an interrupted sweep left running are launched
  again under their own numbers and parameters (with ``resume=auto``, from their checkpoints);
- finished jobs of a resumed sweep are read back, not run again (``app.sweeps.jobs``);
- a job that raises, returns None or NaN (``result.json`` status failed or nan) is told to Optuna as
  a failed trial, never as a value; ``max_failure_rate`` still stops a sweep whose batches fail.

Sampling, distributions, storage and parameter parsing are the plugin's own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from app.sweeps.jobs import NumberedJobs

log = logging.getLogger(__name__)

DIRECTIONS = {"max": "maximize", "min": "minimize"}


class OptunaSearch(OptunaSweeperImpl):
    def __init__(self, **kwargs: Any):
        direction = kwargs.pop("direction")
        direction = getattr(direction, "value", direction)  # ${early_stopping.mode} is a MonitorMode
        if isinstance(direction, str):
            direction = DIRECTIONS.get(direction, direction)
        super().__init__(direction=direction, **kwargs)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        assert self.launcher is not None
        self.jobs = NumberedJobs(self.launcher, config, hydra_context)
        self.sweep_config = config

    def _overrides(self, trial: FrozenTrial | optuna.trial.Trial, fixed: dict[str, Any]) -> list[str]:
        return [f"{name}={value}" for name, value in {**trial.params, **fixed}.items()]

    def sweep(self, arguments: list[str]) -> None:
        self._process_searchspace_config()
        distributions, fixed = create_params_from_overrides(self._parse_sweeper_params_config() + arguments)
        if self.search_space_distributions:
            distributions = {**self.search_space_distributions, **distributions}
        for name in fixed:
            distributions.pop(name, None)
        sweep_dir = Path(str(self.sweep_config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)  # the SQLite storage lives there
        if not (sweep_dir / "multirun.yaml").exists():  # a continued study keeps its first command's
            OmegaConf.save(self.sweep_config, sweep_dir / "multirun.yaml")
        directions = self._get_directions()
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    directions=directions, load_if_exists=True)
        stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        log.info("study %s in %s (%s): %d trial(s) so far, %d left running by an interrupted sweep",
                 study.study_name, self.storage, directions, len(study.trials), len(stale))
        to_go = self.n_trials - len(study.trials)
        again = [(t.number, self._overrides(t, fixed)) for t in stale]
        while again or to_go > 0:
            if again:
                batch, again = again[: self.n_jobs], again[self.n_jobs:]
            else:
                trials = [study.ask() for _ in range(min(self.n_jobs, to_go))]
                to_go -= len(trials)
                for trial in trials:
                    for name, distribution in distributions.items():
                        trial._suggest(name, distribution)
                    for name, value in fixed.items():
                        trial.set_user_attr(name, value)
                    if self.custom_search_space_extender:
                        self.custom_search_space_extender(self.sweep_config, trial)
                batch = [(t.number, self._overrides(t, fixed)) for t in trials]
            returns = self.jobs.launch(batch)
            self._tell(study, [n for n, _ in batch], returns)
        self._save_best(study, sweep_dir)

    def _tell(self, study: optuna.Study, numbers: Sequence[int], returns: Sequence[JobReturn]) -> None:
        failures = []
        for number, ret in zip(numbers, returns):
            try:
                values = [float(ret.return_value)] if len(self._get_directions()) == 1 else [
                    float(v) for v in ret.return_value]
                study.tell(number, values)  # raises ValueError for NaN, leaving the trial to fail below
            except Exception as err:  # noqa: BLE001 - the job's own error, or a value Optuna refuses
                study.tell(number, state=TrialState.FAIL)
                log.warning("trial %d failed: %s", number, err)
                failures.append(err)
        if failures and len(failures) / len(returns) > self.max_failure_rate:
            raise RuntimeError(f"{len(failures)} of {len(returns)} trials in a batch failed (more than "
                               f"hydra.sweeper.max_failure_rate={self.max_failure_rate}); first: {failures[0]}")

    def _save_best(self, study: optuna.Study, sweep_dir: Path) -> None:
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            log.warning("no trial of study %s finished with a value", study.study_name)
            return
        if len(self._get_directions()) == 1:
            best = study.best_trial
            results: dict[str, Any] = {"name": "optuna", "best_trial": best.number, "best_params": best.params,
                                       "best_value": best.value}
            log.info("best trial %d: %s = %s", best.number, best.params, best.value)
        else:
            results = {"name": "optuna", "solutions": [{"trial": t.number, "params": t.params, "values": t.values}
                                                       for t in study.best_trials]}
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
