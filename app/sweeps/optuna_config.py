"""``hydra/sweeper=optuna``: the schema of our Optuna sweeper's settings (``hydra.sweeper.*``).

Stored in Hydra's ConfigStore as ``hydra/sweeper/optuna_schema`` when Hydra scans its plugins
(``hydra_plugins/app_sweepers``); ``conf/hydra/sweeper/optuna.yaml`` extends it. A typo key, a wrong
type or an unknown sampler/pruner name is refused when the config is composed; :meth:`check` refuses
the rest in one sentence before the study is opened. Torch- and optuna-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from app.config import ConfigError, MonitorMode

SWEEPER_TARGET = "hydra_plugins.app_sweepers.resumable.ResumableOptunaSweeper"


class SamplerName(enum.Enum):
    """``hydra.sweeper.sampler``: how the next trial's parameters are chosen (``app.sweeps.optuna_objects``)."""

    tpe = "tpe"
    """Tree-structured Parzen estimator, multivariate (the parameters' joint density, not one at a time)."""
    random = "random"
    cmaes = "cmaes"
    """CMA-ES over the numeric parameters (the ``cmaes`` package); categorical ones are sampled at random."""
    gp = "gp"
    """Gaussian-process Bayesian optimisation (scipy and torch)."""
    grid = "grid"
    """Every combination of the choice()/range() values, once; no interval()."""


class PrunerName(enum.Enum):
    """``hydra.sweeper.pruner``: which trials stop early, from the evaluations they report."""

    median = "median"
    """Stop a trial whose best value so far is worse than the median of the completed trials at the same
    evaluation."""
    hyperband = "hyperband"
    """Successive halving over several brackets of trial budgets (Optuna's HyperbandPruner)."""
    none = "none"
    """Every trial runs to its own end."""


@dataclass
class OptunaSweeperConfig:
    _target_: str = SWEEPER_TARGET
    direction: MonitorMode = MonitorMode.max
    """max or min: the objective is each trial's best early_stopping.monitor value (the YAML takes
    ``${early_stopping.mode}``)."""
    study_name: str = "app"
    storage: str | None = None
    """Any URL Optuna takes (``sqlite:///path.db``, ``postgresql://...``); null: ``sqlite:///<sweep folder>/optuna.db``."""
    n_trials: int = 20
    """Trials of the whole study: the same command continues an interrupted study up to this many."""
    n_jobs: int = 2
    """Trials asked together and launched as one batch (a parallel launcher runs them at once)."""
    sampler: SamplerName = SamplerName.tpe
    seed: int | None = None
    """The sampler's seed: the same seed asks the same first trials."""
    pruner: PrunerName = PrunerName.median
    pruner_warmup_evaluations: int = 2
    """No trial is pruned at its first this-many evaluations (hyperband: its first rung comes after them)."""
    pruner_startup_trials: int = 5
    """median: no trial is pruned before this many trials completed (their curves are the reference)."""
    max_failure_rate: float = 0.0
    """The largest fraction of failed trials in a batch before the sweep stops."""
    params: dict[str, str] = field(default_factory=dict)
    """Parameter -> Hydra sweep syntax: ``interval(a, b)``, ``tag(log, interval(a, b))``, ``choice(...)``,
    ``range(start, stop[, step])``; a plain value is fixed for every trial."""
    custom_search_space: str | None = None
    """A function's dotted path, called as ``f(config, trial)`` on each new trial to suggest more parameters
    (Optuna's define-by-run API); its suggestions become the trial's overrides too."""

    def check(self) -> None:
        if self.n_trials < 1 or self.n_jobs < 1:
            raise ConfigError(f"hydra.sweeper.n_trials and hydra.sweeper.n_jobs must be 1 or more, got "
                              f"{self.n_trials} and {self.n_jobs}.")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise ConfigError(f"hydra.sweeper.max_failure_rate must be in [0, 1], got {self.max_failure_rate}.")
        if self.pruner_warmup_evaluations < 0 or self.pruner_startup_trials < 0:
            raise ConfigError("hydra.sweeper.pruner_warmup_evaluations and hydra.sweeper.pruner_startup_trials "
                              "must be 0 or more.")

    @staticmethod
    def from_hydra(settings: dict[str, Any]) -> OptunaSweeperConfig:
        """The sweeper's keyword arguments as Hydra instantiates them (DictConfigs, enums), typed and checked."""
        plain = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for k, v in settings.items()}
        merged = OmegaConf.merge(OmegaConf.structured(OptunaSweeperConfig), plain)
        typed = OmegaConf.to_object(merged)
        assert isinstance(typed, OptunaSweeperConfig)
        typed.check()
        return typed
