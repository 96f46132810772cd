"""The only place where the Optuna sweeper's names become Optuna objects: the sampler, the pruner (the
same in the sweeper and in every job, built from the same settings) and the storage."""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from app.config import ConfigError
from app.sweeps.optuna_config import PrunerName, SamplerName
from app.sweeps.search_space import SearchSpace

if TYPE_CHECKING:
    import optuna

SQLITE_TIMEOUT_S = 60.0
"""How long a job waits for the SQLite file's lock (the sweeper and parallel jobs write to it)."""

_NEEDS = {SamplerName.cmaes: ("the cmaes package (pip install cmaes)", ("cmaes",)),
          SamplerName.gp: ("scipy and torch (pip install scipy torch)", ("scipy", "torch"))}
"""What a sampler needs beyond optuna (which imports it only at the first trial), and how to install it."""


def build_sampler(name: SamplerName, seed: int | None, space: SearchSpace) -> optuna.samplers.BaseSampler:
    """The sampler ``hydra.sweeper.sampler`` names, seeded; one sentence if its own package is missing."""
    import optuna

    if name in _NEEDS and any(importlib.util.find_spec(package) is None for package in _NEEDS[name][1]):
        raise ConfigError(f"hydra.sweeper.sampler={name.value} needs {_NEEDS[name][0]}, which is not installed.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # multivariate, constant_liar in 4.x
        if name is SamplerName.tpe:
            # multivariate: the parameters' joint density (lr and batch size interact); constant liar:
            # trials asked together (n_jobs) are not all put on the same spot.
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
        if name is SamplerName.random:
            return optuna.samplers.RandomSampler(seed=seed)
        if name is SamplerName.cmaes:
            return optuna.samplers.CmaEsSampler(seed=seed)
        if name is SamplerName.gp:
            return optuna.samplers.GPSampler(seed=seed)
    assert name is SamplerName.grid

    class GridSampler(optuna.samplers.GridSampler):
        def after_trial(self, *args: Any, **kwargs: Any) -> None:
            """Nothing: Optuna's stops the study once its grid is done, which only an optimize() loop
            allows (ask/tell raises); our sweeper asks no more trials than the grid holds."""

    return GridSampler(space.grid(), seed=seed)


def build_pruner(name: PrunerName, warmup_evaluations: int, startup_trials: int) -> optuna.pruners.BasePruner:
    """A trial's evaluations are numbered from 1 (its Optuna steps): the first ``warmup_evaluations`` of
    them never prune it."""
    import optuna

    if name is PrunerName.median:
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_evaluations + 1)
    if name is PrunerName.hyperband:
        return optuna.pruners.HyperbandPruner(min_resource=warmup_evaluations + 1, max_resource="auto")
    return optuna.pruners.NopPruner()


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The study's storage: any URL Optuna's RDB storage takes. SQLite waits for its lock instead of
    failing at once (the jobs report their evaluations while the sweeper reads)."""
    import optuna
    from sqlalchemy.exc import ArgumentError

    engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite:") else {}
    scheme = url.split("://")[0]  # never the whole URL: it may hold a password
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except ImportError as err:  # a database driver (psycopg2, pymysql...) that is not installed
        raise ConfigError(f"hydra.sweeper.storage={scheme}://... needs a database driver that is not installed "
                          f"({err}).") from None
    except ArgumentError:
        raise ConfigError(f"hydra.sweeper.storage={scheme}... is not a database URL (sqlite:///<file>, "
                          "postgresql://<user>@<host>/<database>, ...).") from None


def shown(url: str) -> str:
    """A storage URL for logs and messages: its password masked."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("://")[0] + "://..."
