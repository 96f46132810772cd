"""Our Optuna sweeper (``hydra/sweeper=optuna``) on Optuna's ask/tell API:

- the search space is Hydra's sweep syntax (``app.sweeps.search_space``); the sampler, pruner and storage
  are named in ``hydra.sweeper`` (``app.sweeps.optuna_config``, built by ``app.sweeps.optuna_objects``);
- the direction is ``early_stopping.mode``'s; a trial's job number is its trial number, so a continued
  study never puts a new trial in an earlier trial's folder;
- ``n_trials`` counts the study's trials: the same command continues an interrupted study up to
  n_trials; trials an interrupted sweep left running are launched again under their own numbers and
  parameters (with ``resume=auto``, from their checkpoints); finished jobs of a resumed sweep are read
  back, not run again (``app.sweeps.jobs``);
- with a pruner, each job reports its evaluations to the study and stops when told to
  (``app.sweeps.trial_pruning``); it is then told to the study as pruned;
- a job that raises, returns None or NaN (``result.json`` failed or nan) is a failed trial, never a
  value; ``max_failure_rate`` stops a sweep whose batches fail.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from app.config import ConfigError, MonitorMode
from app.sweeps.jobs import NumberedJobs
from app.sweeps.optuna_config import OptunaSweeperConfig, PrunerName, SamplerName
from app.sweeps.optuna_objects import build_pruner, build_sampler, open_storage, shown
from app.sweeps.search_space import SearchSpace, parse_search_space
from app.sweeps.study_link import FOLDER_ATTR, PRUNED_ATTR, StudyLink, exported, folder_key

log = logging.getLogger(__name__)

DIRECTIONS = {MonitorMode.max: optuna.study.StudyDirection.MAXIMIZE, MonitorMode.min: optuna.study.StudyDirection.MINIMIZE}
RESULTS_FILE = "optimization_results.yaml"


class OptunaSearch:
    def __init__(self, settings: OptunaSweeperConfig):
        self.settings = settings
        self.direction = DIRECTIONS[settings.direction]

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweep_config = config
        self.hydra_context = hydra_context
        launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context, task_function=task_function,
                                                          config=config)
        self.jobs = NumberedJobs(launcher, config, hydra_context)

    def storage_url(self, sweep_dir: Path) -> str:
        return self.settings.storage or f"sqlite:///{sweep_dir}/optuna.db"

    def sweep(self, arguments: list[str]) -> None:
        s = self.settings
        space = parse_search_space(s.params, arguments, self.hydra_context.config_loader)
        sweep_dir = Path(str(self.sweep_config.hydra.sweep.dir))
        sampler = build_sampler(s.sampler, s.seed, space)  # refuses a grid of intervals before anything is written
        sweep_dir.mkdir(parents=True, exist_ok=True)  # the SQLite storage lives there
        url = self.storage_url(sweep_dir)
        self.storage = open_storage(url)
        study = optuna.create_study(study_name=s.study_name, storage=self.storage, sampler=sampler,
                                    pruner=build_pruner(s.pruner, s.pruner_warmup_evaluations, s.pruner_startup_trials),
                                    direction=self.direction, load_if_exists=True)
        if study.direction != self.direction:
            raise ConfigError(f"study {s.study_name} in {shown(url)} was made to {study.direction.name.lower()}, not to "
                              f"{self.direction.name.lower()} (early_stopping.mode={s.direction.value}); use another "
                              "hydra.sweeper.study_name or hydra.sweep.dir.")
        if not (sweep_dir / "multirun.yaml").exists():  # a continued study keeps its first command's
            OmegaConf.save(self.sweep_config, sweep_dir / "multirun.yaml")
        n_trials = s.n_trials
        if s.sampler is SamplerName.grid:
            n_trials = min(n_trials, math.prod(len(v) for v in space.grid().values()))
        stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        asked = len(study.get_trials(deepcopy=False)) - len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        log.info("study %s in %s (%s, %s sampler, %s pruner): %d trial(s) so far, %d left running by an "
                 "interrupted sweep; %d to go", study.study_name, shown(url), study.direction.name.lower(), s.sampler.value,
                 s.pruner.value, asked, len(stale), max(0, n_trials - asked) + len(stale))
        link = None if s.pruner is PrunerName.none else StudyLink(
            storage=url, study_name=s.study_name, pruner=s.pruner, warmup_evaluations=s.pruner_warmup_evaluations,
            startup_trials=s.pruner_startup_trials)
        with exported(link):  # every process launched from here inherits it
            to_go = n_trials - asked  # trials enqueued by hand (study.enqueue_trial) are asked first
            again = [(t.number, space.overrides(t.params)) for t in stale]
            while again or to_go > 0:
                if again:
                    batch, again = again[: s.n_jobs], again[s.n_jobs:]
                else:
                    trials = [self._ask(study, space) for _ in range(min(s.n_jobs, to_go))]
                    to_go -= len(trials)
                    batch = [(t.number, space.overrides(t.params)) for t in trials]
                self._record_folders(study, batch)
                returns = self.jobs.launch(batch)
                self._tell(study, [n for n, _ in batch], returns)
        self._save_best(study, sweep_dir)

    def _ask(self, study: optuna.Study, space: SearchSpace) -> optuna.Trial:
        trial = study.ask()
        space.suggest(trial)
        if self.settings.custom_search_space:
            get_method(self.settings.custom_search_space)(self.sweep_config, trial)
        return trial

    def _record_folders(self, study: optuna.Study, batch: Sequence[tuple[int, Sequence[str]]]) -> None:
        """Each trial's job folder in the study, where its job looks for its trial (and the dashboard shows it)."""
        study_id = self.storage.get_study_id_from_name(study.study_name)
        for number, overrides in batch:
            trial = optuna.trial.Trial(study, self.storage.get_trial_id_from_study_id_trial_number(study_id, number))
            trial.set_user_attr(FOLDER_ATTR, folder_key(self.jobs.job_folder(number, overrides)))

    def _tell(self, study: optuna.Study, numbers: Sequence[int], returns: Sequence[JobReturn]) -> None:
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        failures = []
        for number, ret in zip(numbers, returns):
            try:
                state, value = outcome(trials.get(number), ret)
            except Exception as err:  # noqa: BLE001 - the job's own error, or a value that is no number
                state, value = TrialState.FAIL, None
                log.warning("trial %d failed: %s", number, err)
                failures.append(err)
            study.tell(number, value, state=state)
            if state is TrialState.PRUNED:
                log.info("trial %d pruned at step %s", number, trials[number].user_attrs.get(PRUNED_ATTR))
        if failures and len(failures) / len(returns) > self.settings.max_failure_rate:
            raise RuntimeError(f"{len(failures)} of {len(returns)} trials in a batch failed (more than "
                               f"hydra.sweeper.max_failure_rate={self.settings.max_failure_rate}); first: {failures[0]}")

    def _save_best(self, study: optuna.Study, sweep_dir: Path) -> None:
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        counts = {state.name.lower(): len(study.get_trials(deepcopy=False, states=(state,)))
                  for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
        if not complete:
            log.warning("no trial of study %s finished with a value (%s)", study.study_name, counts)
            return
        best = study.best_trial
        log.info("best trial %d: %s = %s (trials: %s)", best.number, best.params, best.value, counts)
        results = {"name": "optuna", "best_trial": best.number, "best_params": best.params, "best_value": best.value,
                   "trials": counts}
        OmegaConf.save(OmegaConf.create(results), sweep_dir / RESULTS_FILE)


def outcome(trial: FrozenTrial | None, ret: JobReturn) -> tuple[TrialState, float | None]:
    """How a job's end is told to the study; raises the job's error (or why its value is none)."""
    value = ret.return_value  # a failed job's raises its error
    if trial is not None and PRUNED_ATTR in trial.user_attrs:  # the job pruned it (app.sweeps.trial_pruning)
        return TrialState.PRUNED, None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the job returned {value!r}, not a finite number (result.json says why)")
    return TrialState.COMPLETE, float(value)

