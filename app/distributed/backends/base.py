"""The backend interface: the few operations whose meaning depends on how many processes run and on
what device. One class per hardware kind implements it; the Accelerator and the engine only call it.

This class is also the one-device backend: on one process every collective is the identity. The
multi-process backends (DDP, FSDP2) live in ``torch_distributed.py``, PyTorch/XLA's in ``xla_spmd.py``. What depends on the device type rather than on the process layout (RNG
state, cached memory, the end-of-step hook, fused kernels) is the backend's ``ops``, which the
hardware spec that builds the backend hands it (``app/distributed/hardware/``). How it lays out model
and optimizer state in a checkpoint is its ``checkpoint_io`` (``app/distributed/checkpoint/io.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.distributed.checkpoint.io import CheckpointIO, FullStateIO
from app.distributed.hardware.device import CPU, DeviceOps
from app.distributed.step_flags import StepFlag, SyncFlag

if TYPE_CHECKING:
    from app.distributed.checkpoint.background import WriterCollectives
    from app.distributed.configuration import DistributedDataParallelKwargs


class Backend:
    """Single process on one device. Subclasses override what changes with several processes."""

    def __init__(self, device: torch.device, ops: DeviceOps = CPU):
        """``ops``: the operations of ``device``'s type (its hardware spec's ``DeviceOps``; the CPU's
        by default)."""
        self.device = device
        self.ops: DeviceOps = ops
        self.checkpoint_io: CheckpointIO = FullStateIO(self)
        """How this backend reads and writes model and optimizer state in a checkpoint (the main
        process writes the full state; FSDP2 writes shards)."""

    # -- topology -------------------------------------------------------------------------------------
    num_processes: int = 1
    process_index: int = 0
    local_process_index: int = 0
    num_local_processes: int = 1

    @property
    def distributed_type(self) -> str:
        return "NO"

    @property
    def gradient_replicas(self) -> int:
        """How many processes' gradients this backend averages in backward: 1 here (and on XLA SPMD,
        whose loss is already the whole global batch's); DDP and FSDP2 average every process's. An
        item-normalised backward multiplies by it to undo that mean (``app/distributed/facade/step_items.py``)."""
        return 1

    static_shapes: bool = False
    """Whether every step must see tensors of the same shapes (a compiling backend such as XLA): the
    data loaders then pad their last batch to full size and tasks pad sequences to a fixed length."""

    prefetch_depth: int = 0
    """How many batches a prepared loader loads and places on the device ahead of the loop, in a
    background thread (``app/distributed/data/prefetch.py``); 0: each when the loop asks for it."""

    # -- data -----------------------------------------------------------------------------------------
    def place_batch(self, batch: Any, non_blocking: bool = False) -> Any:
        """Put a batch built on the host onto this backend's device (``non_blocking``: an
        asynchronous copy from pinned memory, ``DataLoaderConfiguration(non_blocking=True)``)."""
        from app.distributed.operations import send_to_device

        return send_to_device(batch, self.device, non_blocking=non_blocking)

    # -- model ----------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Place the model on the device and wrap it for data parallelism."""
        return model.to(self.device)

    def configure_ddp(self, ddp_kwargs: DistributedDataParallelKwargs) -> None:
        """The DDP wrapper's arguments (``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)])``).
        The DDP backend takes them; on one process there is no wrapper to configure (as in
        Accelerate); several processes without DDP (FSDP2, XLA) refuse them."""
        if self.num_processes > 1:
            raise ValueError(f"kwargs_handlers: DistributedDataParallelKwargs needs the DDP backend, but this "
                             f"Accelerator runs {self.distributed_type}; remove it.")

    @property
    def fused_optimizers(self) -> bool:
        """Whether torch's fused optimizer kernels (``AdamW(fused=True)``) run on this backend's
        parameters (see ``DeviceOps.fused_optimizers``)."""
        return self.ops.fused_optimizers

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Skip the gradient all-reduce during accumulation micro-steps."""
        return contextlib.nullcontext()

    def set_requires_gradient_sync(self, model: nn.Module, requires_sync: bool) -> None:
        """FSDP2-style switch; DDP uses no_sync instead."""

    def force_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Synchronise gradients in the next backward even inside ``no_sync``."""
        return contextlib.nullcontext()

    def join(self, joinables: list[Any], enable: bool) -> AbstractContextManager[Any]:
        """Let ranks that ran out of batches shadow the others' collectives (DDP's ``Join``)."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights, on CPU, valid on the main process (others may get {})."""
        return {k: v.detach().cpu() for k, v in self.unwrap_model(model).state_dict().items()}

    # -- collectives (identities on one process) ------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equally-shaped tensors of all ranks along dim 0 (0-d tensors become 1-d)."""
        return tensor.reshape(1) if tensor.dim() == 0 else tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``op`` is ``sum``, ``mean``, ``max`` or ``min``; returns a new tensor."""
        return tensor.clone()

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def background_collectives(self) -> WriterCollectives | None:
        """The collectives a checkpoint writer thread runs beside training (an asynchronous save): on
        one process the identities above, safe from any thread; None where this backend has none to
        spare (the save is then synchronous). Every rank calls it, at the same point."""
        return self if self.num_processes == 1 else None

    def step_flag(self) -> StepFlag:
        """A per-step "did any process raise it?" (``app/distributed/step_flags.py``): here one blocking
        all-reduce per step; the torch.distributed backends answer one step later, without a wait."""
        def any_raised(raised: bool) -> bool:
            return float(self.all_reduce(torch.tensor([float(raised)], device=self.device), "max").item()) > 0

        return SyncFlag(any_raised)

    # -- device operations (see app/distributed/hardware/device.py) ----------------------------------------
    def step_end(self) -> None:
        """Called once after each real optimizer step (by the optimizer wrapper): a lazy device cuts
        its graph here; eager devices do nothing."""
        self.ops.step_end()

    def step_end_hook(self) -> Callable[[], None] | None:
        """:meth:`step_end`, or None where it does nothing (eager devices), so that the optimizer
        wrapper does not call an empty hook after every step."""
        does_something = type(self).step_end is not Backend.step_end or type(self.ops).step_end is not DeviceOps.step_end
        return self.step_end if does_something else None

    def free_memory(self) -> None:
        """Release the memory the device's allocator caches."""
        self.ops.free_memory()

    def rng_state(self) -> dict[str, Any]:
        """The device's RNG states for ``rng_state_<rank>`` (CPU: none beyond torch's own)."""
        return self.ops.rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self.ops.set_rng_state(state)

    def runtime_report(self) -> str | None:
        """One sentence on what the device runtime did during the run (a compiling backend: graphs
        compiled, CPU fallbacks), for the end of the run's log; None where there is nothing to say."""
        return None

    def shutdown(self) -> None:
        pass
