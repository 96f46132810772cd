"""This app's launchers as Hydra plugins (Hydra instantiates launchers only from ``hydra_plugins``).

- ``SlurmLauncher`` (``hydra/launcher=slurm``, ``conf/hydra/launcher/slurm.yaml``): each job of a sweep
  is one SLURM job, ``srun python -m app ...`` with one task per training process, followed with
  ``squeue`` (never ``sacct``) until it ends; see ``app.launching.slurm_sweep``.

Its options' schema is registered here, when Hydra scans its plugins (before it composes the config),
as ``hydra/launcher/slurm_schema``. The rest of the app is imported when a sweep starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from app.launching.slurm_batch import SlurmLauncherConfig

ConfigStore.instance().store(group="hydra/launcher", name="slurm_schema", node=SlurmLauncherConfig,
                             provider="app")


class SlurmLauncher(Launcher):
    def __init__(self, **options: Any) -> None:
        plain: dict[str, Any] = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for k, v in options.items()}
        self.options = SlurmLauncherConfig(**plain)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # The task function is not called here: each job runs python -m app on the cluster.
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from app.launching.slurm_sweep import SlurmSweep

        assert self.config is not None and self.hydra_context is not None
        return SlurmSweep(self.options, self.config, self.hydra_context).launch(job_overrides, initial_job_idx)
