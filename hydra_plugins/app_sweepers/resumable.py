"""This app's sweepers as Hydra plugins (Hydra instantiates sweepers only from ``hydra_plugins``).

- ``ResumableBasicSweeper`` (``hydra/sweeper=resumable``, the app's default): Hydra's grid sweeper;
  with ``resume=auto`` the finished jobs of the sweep folder are read back instead of run again.
- ``ResumableOptunaSweeper`` (``hydra/sweeper=optuna_resumable``, used by ``hparams_search=*``):
  hydra-optuna-sweeper's search with the changes listed in ``app.sweeps.optuna_search``.

The app is imported when a sweep starts, not when Hydra scans its plugins.
"""

from __future__ import annotations

from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class ResumableBasicSweeper(BasicSweeper):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from app.sweeps.jobs import SkipFinishedLauncher

        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        assert self.launcher is not None
        self.launcher = SkipFinishedLauncher(self.launcher, config, hydra_context)


class ResumableOptunaSweeper(Sweeper):
    def __init__(self, **kwargs: Any) -> None:
        from app.sweeps.optuna_search import OptunaSearch

        self.search = OptunaSearch(**kwargs)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.search.sweep(arguments)
