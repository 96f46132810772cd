"""The configuration objects an Accelerate script passes to ``Accelerator`` (same names, fields and
defaults as Accelerate documents them), and the one sentence for those we do not support.

>>> from app.distributed.utils import DataLoaderConfiguration, DistributedDataParallelKwargs
>>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False),
...                           kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class KwargsHandler:
    """Base of the dataclasses passed through ``kwargs_handlers`` (Accelerate's mixin)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) != getattr(default, f.name)}


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for ``torch.nn.parallel.DistributedDataParallel`` and its communication hook; they
    reach the DDP wrapper when the backend is DDP (other backends refuse them)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def ddp_arguments(self) -> dict[str, Any]:
        """The constructor arguments of ``DistributedDataParallel``."""
        return {"dim": self.dim, "broadcast_buffers": self.broadcast_buffers, "bucket_cap_mb": self.bucket_cap_mb,
                "find_unused_parameters": self.find_unused_parameters, "check_reduction": self.check_reduction,
                "gradient_as_bucket_view": self.gradient_as_bucket_view, "static_graph": self.static_graph}

    def register_comm_hook(self, model: Any) -> None:
        """Install the chosen gradient-communication hook on a DDP model."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
                 DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
                 DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
                 DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
                    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
        hook = hooks.get(DDPCommunicationHookType(self.comm_hook))
        if hook is None:
            return
        wrapper = wrappers.get(DDPCommunicationHookType(self.comm_wrapper))
        if wrapper is not None:
            hook = wrapper(hook)  # type: ignore[arg-type]
        power_sgd = self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
        state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option) if power_sgd else None
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class AutocastKwargs(KwargsHandler):
    """``torch.autocast``'s switches under mixed precision: in ``kwargs_handlers`` for prepared models
    and ``accelerator.autocast()``, or given to ``accelerator.autocast(autocast_handler=...)`` for one
    block (``enabled=False``: that code runs in full precision). Without mixed precision there is
    no autocast to configure."""

    enabled: bool = True
    cache_enabled: bool | None = None
    """None: torch's default."""

    def autocast_arguments(self) -> dict[str, Any]:
        arguments: dict[str, Any] = {"enabled": self.enabled}
        if self.cache_enabled is not None:
            arguments["cache_enabled"] = self.cache_enabled
        return arguments


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """``num_steps``: micro-steps per optimizer step. ``adjust_scheduler`` and
    ``sync_with_dataloader`` keep Accelerate's defaults (True); ``sync_each_batch`` synchronises
    gradients on every micro-step (saves memory, costs communication)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders (Accelerate's fields).

    ``dispatch_batches``: the main process reads every batch and sends each process its share
    (default: only for iterable datasets). ``use_seedable_sampler``: shuffle from
    ``data_seed + epoch`` (default seed: ``torch.initial_seed()``), reproducible whatever the
    order of other random draws. ``non_blocking``: batches are copied to the device asynchronously
    (useful with ``pin_memory=True`` loaders on CUDA). ``use_stateful_dataloader``: our prepared
    loaders always have ``state_dict``/``load_state_dict``, so it changes nothing.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where a run writes (Accelerate's fields). ``save_state()`` without a folder always names its
    checkpoints ``<project_dir>/checkpoints/checkpoint_<N>`` (what ``automatic_checkpoint_naming``
    asks for in Accelerate; N continues from the checkpoints already there, so ``iteration`` is not
    needed). ``total_limit``: keep only the N newest of those, the oldest removed after each save."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


UNSUPPORTED_HANDLERS = {
    "GradScalerKwargs": "fp16 loss scaling is configured by the precision object",
    "InitProcessGroupKwargs": "the process group is created by the backend from the launcher's variables "
                              "(its timeout is hardware.collective_timeout_s)",
    "FullyShardedDataParallelPlugin": "FSDP2 is chosen with hardware=fsdp",
    "DeepSpeedPlugin": "DeepSpeed is not supported",
    "TorchDynamoPlugin": "torch.compile is not applied by prepare",
}


def refuse_handler(handler: Any) -> None:
    """Raise the one sentence for a kwargs handler we cannot honour (never drop it silently)."""
    name = type(handler).__name__
    reason = UNSUPPORTED_HANDLERS.get(name, "it is not one we implement")
    raise ValueError(f"kwargs_handlers: {name} is not supported by app.distributed ({reason}); remove it.")
