"""What an ``Accelerator`` holds, for the parts it is made of (this folder): the fields its constructor
(``app/distributed/accelerator.py``) sets, and the views over them that more than one part reads."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from app.distributed.backends.base import Backend
from app.distributed.checkpoint.background import BackgroundWriter
from app.distributed.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from app.distributed.facade.process import ProcessControl
from app.distributed.facade.step_items import StepItems
from app.distributed.hardware.kinds import DistributedType
from app.distributed.precision import Precision
from app.distributed.profiling import ProfileKwargs
from app.distributed.state import AcceleratorState, GradientState
from app.distributed.wrappers import AcceleratedOptimizer, AcceleratedScheduler


class AcceleratorFields(ProcessControl):
    """The Accelerator's state, declared once; ``Accelerator.__init__`` assigns every field."""

    backend: Backend
    """What runs the collectives and wraps the model for this hardware kind (``app/distributed/backends/``)."""
    precision: Precision
    ddp_kwargs: DistributedDataParallelKwargs | None
    autocast_handler: AutocastKwargs | None
    gradient_accumulation_plugin: GradientAccumulationPlugin
    gradient_accumulation_steps: int
    gradient_state: GradientState
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    project_dir: Path | None
    rng_types: list[str]
    device_placement: bool
    step_scheduler_with_optimizer: bool
    scale_scheduler_by_processes: bool
    trackers: list[Any]
    step: int
    """Micro-steps seen by ``accumulate`` (Accelerate's name)."""
    _micro_step: int
    _trigger: bool
    _seed: int | None
    _models: list[nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[Any]
    _custom_objects: list[Any]
    _save_state_pre_hooks: OrderedDict[int, Callable[..., Any]]
    _load_state_pre_hooks: OrderedDict[int, Callable[..., Any]]
    _checkpoint_writer: BackgroundWriter
    _step_items: StepItems
    """The items back-propagated in the optimizer step being accumulated (``backward(num_items=...)``)."""
    _state: AcceleratorState
    _profile_handler: ProfileKwargs | None
    _log_with: list[str]

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` view of this Accelerator."""
        return self._state

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def static_shapes(self) -> bool:
        """True when every step must see the same tensor shapes (XLA): prepared loaders then pad their
        last batch to full size, and a task should pad sequences to a fixed length."""
        return self.backend.static_shapes

    @property
    def shards_the_model(self) -> bool:
        """True where the model's parameters are sharded across processes (FSDP2): every process must
        run each forward pass, generation included."""
        return self.backend.distributed_type == DistributedType.FSDP

