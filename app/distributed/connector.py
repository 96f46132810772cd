"""The one place where ``Accelerator``'s constructor arguments become what it runs with (Fabric's
``connector.py``): the backend, the precision, the options of the DDP wrapper, the profiler and
autocast, the data-loader and project configurations, the trackers to start.

An argument that cannot be honoured is refused here with one sentence (a ``ValueError``), never
dropped: the Accelerator then holds only settings that have an effect.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.distributed.backends.base import Backend
from app.distributed.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    refuse_handler,
)
from app.distributed.launchers import MIXED_PRECISION_ENV
from app.distributed.precision import Precision, build_precision
from app.distributed.profiling import ProfileKwargs
from app.distributed.state import default_backend

SYNCHRONISED_RNG_TYPES = ("generator",)
"""What ``rng_types`` may name: a prepared loader copies rank 0's sampler generator at every pass."""


@dataclass
class Connected:
    """An Accelerator's settings, resolved from its arguments."""

    backend: Backend
    precision: Precision
    gradient_accumulation_plugin: GradientAccumulationPlugin
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    project_dir: Path | None
    log_with: list[str]
    rng_types: list[str]
    ddp_kwargs: DistributedDataParallelKwargs | None = None
    """The DDP wrapper's arguments (already handed to the backend: ``Backend.configure_ddp``)."""
    profile_handler: ProfileKwargs | None = None
    """What ``Accelerator.profile()`` uses when it is given none."""
    autocast_handler: AutocastKwargs | None = None
    """The autocast settings of prepared models and of ``Accelerator.autocast()``."""


def connect(*, split_batches: bool, mixed_precision: str | None, gradient_accumulation_steps: int, cpu: bool,
            dataloader_config: DataLoaderConfiguration | None, project_dir: str | os.PathLike[str] | None,
            project_config: ProjectConfiguration | None,
            gradient_accumulation_plugin: GradientAccumulationPlugin | None,
            log_with: str | Sequence[str] | None, even_batches: bool, rng_types: Sequence[str] | None,
            kwargs_handlers: Sequence[Any] | None, downcast_bf16: bool, backend: Backend | None) -> Connected:
    """Resolve the constructor's arguments (Accelerate's names and defaults), or raise ``ValueError``
    with one sentence for one that cannot be honoured."""
    plugin = _accumulation(gradient_accumulation_steps, gradient_accumulation_plugin)
    if backend is not None and cpu:
        raise ValueError("pass backend= or cpu=True, not both: a given backend already decides the device.")
    if downcast_bf16:
        raise ValueError("downcast_bf16=True is not supported: mixed_precision='bf16' is torch.autocast here (bf16 "
                         "compute, fp32 weights and optimizer states, on every device); remove it.")
    unsynchronised = [name for name in rng_types or () if str(getattr(name, "value", name)) not in SYNCHRONISED_RNG_TYPES]
    if unsynchronised:
        raise ValueError(f"rng_types={list(rng_types or ())} is not supported: a prepared loader synchronises only the "
                         "sampler's 'generator' (seeded loaders shuffle from seed + epoch, the same on every process); "
                         "pass rng_types=['generator'] or leave it out.")
    if dataloader_config is not None and (split_batches or not even_batches):
        raise ValueError("pass split_batches/even_batches or dataloader_config, not both: set them on the "
                         "DataLoaderConfiguration.")
    project = project_config or ProjectConfiguration()
    if project_dir is not None and project.project_dir is not None and Path(project_dir) != Path(project.project_dir):
        raise ValueError(f"project_dir={str(project_dir)!r} and project_config.project_dir={project.project_dir!r} "
                         "differ; pass one of them.")
    if project.save_on_each_node:
        raise ValueError("ProjectConfiguration(save_on_each_node=True) is not supported: checkpoints are written by the "
                         "main process, on a filesystem every node reads; remove it.")
    folder = project_dir if project_dir is not None else project.project_dir
    ddp_kwargs, profile_handler, autocast_handler = _read_kwargs_handlers(kwargs_handlers or ())
    # Only now, with every argument accepted: building the backend may join the launcher's process group.
    chosen = backend if backend is not None else default_backend(cpu)
    if ddp_kwargs is not None:
        chosen.configure_ddp(ddp_kwargs)
    # Unset: what a launcher asked for (notebook_launcher's mixed_precision, Accelerate's variable).
    precision = build_precision(mixed_precision or os.environ.get(MIXED_PRECISION_ENV) or "no", chosen.device)
    names = [log_with] if isinstance(log_with, str) else list(log_with or [])
    if "all" in names:
        names = [n for n in names if n != "all"] + available_trackers()
    return Connected(
        backend=chosen, precision=precision, gradient_accumulation_plugin=plugin,
        dataloader_config=dataloader_config or DataLoaderConfiguration(split_batches=split_batches,
                                                                       even_batches=even_batches),
        project_configuration=project, project_dir=Path(folder) if folder is not None else None, log_with=names,
        rng_types=[str(getattr(n, "value", n)) for n in rng_types] if rng_types is not None else ["generator"],
        ddp_kwargs=ddp_kwargs, profile_handler=profile_handler, autocast_handler=autocast_handler)


def _accumulation(steps: int, plugin: GradientAccumulationPlugin | None) -> GradientAccumulationPlugin:
    if plugin is not None:
        if steps != 1:
            raise ValueError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both.")
        steps = plugin.num_steps or 1
    else:
        plugin = GradientAccumulationPlugin(num_steps=steps)
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}.")
    return plugin


def _read_kwargs_handlers(handlers: Sequence[Any]) -> tuple[DistributedDataParallelKwargs | None,
                                                            ProfileKwargs | None, AutocastKwargs | None]:
    """The handlers we honour, one of each kind at most; any other is refused (``refuse_handler``)."""
    found: dict[type, Any] = {}
    for handler in handlers:
        kind: type | None = next((k for k in (DistributedDataParallelKwargs, ProfileKwargs, AutocastKwargs)
                                  if isinstance(handler, k)), None)
        if kind is None:
            refuse_handler(handler)
            continue
        if kind in found:
            raise ValueError(f"kwargs_handlers: {kind.__name__} is given twice; pass it once.")
        found[kind] = handler
    return found.get(DistributedDataParallelKwargs), found.get(ProfileKwargs), found.get(AutocastKwargs)


def available_trackers() -> list[str]:
    """What ``log_with="all"`` starts: every tracker we support whose package is installed (Accelerate's rule)."""
    from app.distributed.hardware.availability import is_tensorboard_available, is_wandb_available

    return [name for name, installed in (("tensorboard", is_tensorboard_available()), ("wandb", is_wandb_available()))
            if installed]
