"""A pruned sweep's trial, seen from its job: every scheduled evaluation reports ``early_stopping.monitor``
to the study, and when the study's pruner says the trial is clearly worse than the others were at the
same evaluation, the job stops as on an early stop (``app.engine.pruning``).

The job talks to the study storage itself (:class:`app.sweeps.study_link.StudyLink`), so any launcher
runs it: basic, joblib, submitit, SLURM. Only the main process does; the loop's stop trigger makes
every process stop at the same step. A trial's Optuna steps are its evaluations, numbered from 1 (the
optimizer step // ``trainer.eval_every_n_steps``, or the epoch when evaluating once per epoch), so
trials whose batch sizes differ compare at the same amount of training.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import RunConfig
from app.engine.pruning import NoPruning, PrunedAt, Pruning
from app.sweeps.optuna_config import PrunerName
from app.sweeps.study_link import FOLDER_ATTR, PRUNED_ATTR, StudyLink, folder_key

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

EVALUATION_ATTR = "pruned_at_evaluation"


class StudyPruning:
    """The main process's link to its trial."""

    def __init__(self, trial: optuna.Trial, link: StudyLink, monitor: str, eval_every: int | None):
        self.trial = trial
        self.pruner = link.pruner
        self.monitor = monitor
        self.eval_every = eval_every
        attrs = trial.user_attrs
        # An earlier segment of this run pruned the trial (the run was resumed after its stop).
        self.pruned_at = (PrunedAt(int(attrs[EVALUATION_ATTR]), int(attrs[PRUNED_ATTR]))
                          if PRUNED_ATTR in attrs else None)

    def evaluation(self, step: int, epoch: int) -> int:
        return step // self.eval_every if self.eval_every is not None else epoch

    def after_evaluation(self, step: int, epoch: int, metrics: dict[str, float], stopping: bool) -> str | None:
        evaluation = self.evaluation(step, epoch)
        value = float(metrics[self.monitor])
        with warnings.catch_warnings():
            # A resumed run evaluates again at a step it reported before its checkpoint: Optuna keeps the
            # first value (the same one) and warns.
            warnings.simplefilter("ignore", UserWarning)
            self.trial.report(value if math.isfinite(value) else math.nan, evaluation)
        if stopping or not self.trial.should_prune():
            return None
        self.pruned_at = PrunedAt(evaluation, step)
        self.trial.set_user_attr(EVALUATION_ATTR, evaluation)
        self.trial.set_user_attr(PRUNED_ATTR, step)  # the sweeper tells the trial as pruned by this
        return (f"pruned by the sweep's {self.pruner.value} pruner at evaluation {evaluation} (step {step}): "
                f"its best {self.monitor} so far is worse than the study's other trials at that evaluation")


def build_pruning(cfg: RunConfig, run_dir: Path, is_main_process: bool) -> Pruning:
    """The run's pruning: :class:`StudyPruning` on the main process of a pruned sweep's job, else none."""
    link = StudyLink.from_env()
    if link is None or link.pruner is PrunerName.none or not is_main_process:
        return NoPruning()
    import optuna
    from optuna.trial import TrialState

    from app.sweeps.optuna_objects import build_pruner, open_storage

    storage = open_storage(link.storage)
    study = optuna.load_study(study_name=link.study_name, storage=storage,
                              pruner=build_pruner(link.pruner, link.warmup_evaluations, link.startup_trials))
    folder = folder_key(run_dir)
    mine = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if t.user_attrs.get(FOLDER_ATTR) == folder]
    if not mine:
        log.warning("no running trial of study %s has the run folder %s: this run reports to no study and is "
                    "never pruned", link.study_name, folder)
        return NoPruning()
    number = mine[-1].number
    trial = optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(link.study_name), number))
    log.info("trial %d of study %s: %s is reported at every evaluation, and the %s pruner may stop it",
             number, link.study_name, cfg.early_stopping.monitor, link.pruner.value)
    return StudyPruning(trial, link, cfg.early_stopping.monitor, cfg.trainer.eval_every_n_steps)
