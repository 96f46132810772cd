"""This app's sweepers as Hydra plugins (Hydra instantiates sweepers only from ``hydra_plugins``).

- ``ResumableBasicSweeper`` (``hydra/sweeper=resumable``, the app's default): Hydra's grid sweeper;
  with ``resume=auto`` the finished jobs of the sweep folder are read back instead of run again.
- ``ResumableOptunaSweeper`` (``hydra/sweeper=optuna``, used by ``hparams_search=*``): our Optuna
  search (``app.sweeps.optuna_search``); its settings' schema is stored here, as ``hydra/sweeper/optuna_schema``,
  when Hydra scans its plugins (``conf/hydra/sweeper/optuna.yaml`` extends it).

Beyond that schema (torch- and optuna-free), the app is imported when a sweep starts, not when Hydra
scans its plugins.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from app.sweeps.optuna_config import OptunaSweeperConfig

ConfigStore.instance().store(group="hydra/sweeper", name="optuna_schema", node=OptunaSweeperConfig, provider="app")


def _refusing_bad_input(sweep: Callable[[list[str]], Any], arguments: list[str]) -> Any:
    """A resumed sweep whose folder holds other jobs, or sweeper settings that cannot work: one sentence
    and exit code 2, as for any bad input."""
    from app.config import ConfigError
    from app.sweeps.jobs import SweepResumeError

    try:
        return sweep(arguments)
    except (SweepResumeError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


class ResumableBasicSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        return _refusing_bad_input(self._checked_sweep, arguments)

    def _checked_sweep(self, arguments: list[str]) -> Any:
        """With resume=auto, every job folder is checked before the sweep writes anything (the basic
        sweeper rewrites multirun.yaml first)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from app.sweeps.jobs import SkipFinishedLauncher, resumes

        assert self.hydra_context is not None and isinstance(self.launcher, SkipFinishedLauncher)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(self._parse_config() + arguments), None)
        jobs = [job for batch in batches for job in batch]
        for number, overrides in enumerate(jobs):
            if resumes(overrides):
                self.launcher.jobs.check(number, overrides)
        return super().sweep(arguments)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from app.sweeps.jobs import SkipFinishedLauncher

        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        assert self.launcher is not None
        self.launcher = SkipFinishedLauncher(self.launcher, config, hydra_context)


class ResumableOptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings  # typed and checked in sweep(), where a refusal is one sentence

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.context = {"hydra_context": hydra_context, "task_function": task_function, "config": config}

    def sweep(self, arguments: list[str]) -> Any:
        return _refusing_bad_input(self._search, arguments)

    def _search(self, arguments: list[str]) -> None:
        from app.sweeps.optuna_search import OptunaSearch

        search = OptunaSearch(OptunaSweeperConfig.from_hydra(self.settings))
        search.setup(**self.context)
        search.sweep(arguments)
