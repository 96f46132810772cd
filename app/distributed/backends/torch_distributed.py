"""Multi-process backends on ``torch.distributed``: DDP and FSDP2 (``fully_shard``), one process per
CPU worker (gloo) or per GPU (nccl for CUDA tensors, gloo for CPU tensors).

Both read the process layout from the variables torchrun and torch's elastic launcher set (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and create the process group with
a timeout, so a collective whose peer died fails instead of hanging. The device and the collective
library come from the hardware spec's ``DeviceOps`` (``app/distributed/hardware/``); besides that
package, only this file names a device type, for torch APIs that differ on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from app import this_process
from app.distributed.backends.base import Backend
from app.distributed.checkpoint.sharded_io import ShardedStateIO
from app.distributed.hardware.device import CPU, DeviceOps
from app.distributed.step_flags import LaggedFlag, StepFlag

log = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_LAYOUT_VARS = (this_process.RANK, this_process.WORLD_SIZE, "MASTER_ADDR", "MASTER_PORT")


class TorchDistributedBackend(Backend):
    """One rank of a process group: the collectives shared by DDP and FSDP2."""

    def __init__(self, device: torch.device, *, process_index: int, num_processes: int,
                 local_process_index: int, num_local_processes: int, owns_group: bool = False,
                 ops: DeviceOps = CPU):
        super().__init__(device, ops)
        self.process_index = process_index
        self.num_processes = num_processes
        self.local_process_index = local_process_index
        self.num_local_processes = num_local_processes
        self._owns_group = owns_group
        self._writers: _GroupCollectives | None = None

    @classmethod
    def from_environment(cls, device_ops: DeviceOps = CPU, timeout_s: float = 600.0,
                         **kwargs: Any) -> TorchDistributedBackend:
        """Join the process group described by torchrun's environment variables (creating it unless
        this process already has one) on ``device_ops``'s device type and collective library (the
        hardware spec chooses; the CPU's gloo by default). ``kwargs`` go to the subclass constructor."""
        missing = [name for name in _LAYOUT_VARS if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"{cls.__name__} needs the variables a launcher sets ({', '.join(missing)} missing); start with "
                "python -m app hardware=multi_cpu hardware.num_processes=N, or with torchrun."
            )
        rank, world = this_process.rank(), this_process.world_size()
        local_rank = this_process.local_rank(default=rank)
        local_world = this_process.local_world_size(default=world)
        device = device_ops.local_device(local_rank)
        owns_group = not dist.is_initialized()
        if owns_group:
            dist.init_process_group(device_ops.collective_backend, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        backend = cls(device, process_index=rank, num_processes=world, local_process_index=local_rank,
                      num_local_processes=local_world, owns_group=owns_group, ops=device_ops, **kwargs)
        backend.timeout_s = timeout_s
        return backend

    timeout_s: float = 600.0
    """How long a collective waits for a peer (the process group's timeout; the checkpoint writers' too)."""

    @property
    def gradient_replicas(self) -> int:
        """DDP all-reduces and FSDP2 reduce-scatters gradients as a mean over every process."""
        return self.num_processes

    # -- collectives ----------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate along dim 0. Ranks may hold different dim-0 sizes (the last batch of an uneven
        split): sizes are gathered first, every rank pads to the largest, and the padding is cut off."""
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        # gloo has no bool collectives; uint8 carries the same values.
        is_bool = tensor.dtype is torch.bool
        if is_bool:
            tensor = tensor.to(torch.uint8)
        size = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        sizes = [torch.empty_like(size) for _ in range(self.num_processes)]
        dist.all_gather(sizes, size)
        counts = [int(s.item()) for s in sizes]
        longest = max(counts)
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor)
        out = torch.cat([part[:count] for part, count in zip(parts, counts)])
        return out.bool() if is_bool else out

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.num_processes
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if op not in _OPS:
            raise ValueError(f"reduction must be one of {sorted(_OPS)}, got {op!r}.")
        out = tensor.detach().clone()
        dist.all_reduce(out, op=_OPS[op])
        # ReduceOp.AVG exists only on nccl: divide a sum instead (integers become floats).
        return out / self.num_processes if op == "mean" else out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        out = tensor.detach().clone().contiguous()
        dist.broadcast(out, src=src)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def background_collectives(self) -> _GroupCollectives:
        """Collectives on a gloo group of their own (made by every rank at its first asynchronous save):
        the checkpoint writers' threads run them while the training threads run theirs on the default
        group, and two threads never share one group."""
        if self._writers is None:
            self._writers = _GroupCollectives(dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s)),
                                              self.num_processes)
        return self._writers

    def step_flag(self) -> StepFlag:
        """Answered one step late, by an asynchronous all-reduce of a host tensor: no wait and, on
        GPUs, no device sync per step (over a gloo group made once beside nccl)."""
        return LaggedFlag(self._host_group())

    def _host_group(self) -> Any:
        """A process group for CPU tensors: the default one when it is gloo; a collective call (every
        rank makes it, at the same point) the first time otherwise."""
        if dist.get_backend() == "gloo":
            return None
        if "_host_group_" not in self.__dict__:
            self.__dict__["_host_group_"] = dist.new_group(backend="gloo")
        return self.__dict__["_host_group_"]

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


class _GroupCollectives:
    """``all_gather_object``, ``broadcast_object`` and ``barrier`` on one process group (``group``, also
    what torch.distributed.checkpoint synchronises on in a writer thread)."""

    def __init__(self, group: Any, world: int):
        self.group, self.world = group, world

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class DDPBackend(TorchDistributedBackend):
    """``DistributedDataParallel``: every rank holds the whole model; gradients are all-reduced
    (averaged) during backward."""

    @property
    def distributed_type(self) -> str:
        return "MULTI_CPU" if self.device.type == "cpu" else "MULTI_GPU"

    ddp_kwargs: Any = None
    """A ``DistributedDataParallelKwargs`` (from ``Accelerator(kwargs_handlers=...)``): the DDP
    constructor's arguments and a communication hook."""

    def configure_ddp(self, ddp_kwargs: Any) -> None:
        self.ddp_kwargs = ddp_kwargs  # read by wrap_model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (a frozen or evaluation-only model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        arguments = self.ddp_kwargs.ddp_arguments() if self.ddp_kwargs is not None else {}
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **arguments)
        if self.ddp_kwargs is not None:
            self.ddp_kwargs.register_comm_hook(wrapped)
        self._wrapped.add(wrapped)
        return wrapped

    @property
    def _wrapped(self) -> weakref.WeakSet[nn.Module]:
        """The DDP models this backend made (weakly held: a dropped model is no longer listed)."""
        return self.__dict__.setdefault("_wrapped_models", weakref.WeakSet())

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            # DDP's C++ reducer (and the logger sharing it) hold the process group. Freed later, with
            # the model, they would run gloo's destructor under the GIL: it joins gloo's worker threads,
            # one of which may be waiting for that GIL to free a finished collective's tensors, and the
            # process hangs for ever (pytorch/pytorch#56297; seen at the end of 2-process runs). Freed
            # here, the group's last reference goes with destroy_process_group, which drops the GIL.
            for model in list(self._wrapped):
                model.__dict__.pop("reducer", None)
                model.__dict__["logger"] = None
        super().shutdown()

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def set_requires_gradient_sync(self, model: nn.Module, requires_sync: bool) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.require_backward_grad_sync = requires_sync

    @contextlib.contextmanager
    def force_sync(self, model: nn.Module) -> Iterator[None]:
        """Synchronise in the next backward although the forward ran under ``no_sync``: DDP decides
        at forward time, so its reducer is told again here (what Accelerate does)."""
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            yield
            return
        before = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = before

    def join(self, joinables: list[Any], enable: bool) -> AbstractContextManager[Any]:
        from torch.distributed.algorithms import Join, Joinable

        # DDP models (and e.g. ZeroRedundancyOptimizer) know how to shadow their peers' collectives.
        usable = [j for j in joinables if isinstance(j, Joinable)]
        if not usable:
            return contextlib.nullcontext()
        return Join(usable, enable=enable, throw_on_early_termination=False)


class FSDPBackend(TorchDistributedBackend):
    """FSDP2: parameters, gradients and optimizer states are sharded across ranks (``fully_shard``
    on each layer, then on the root); parameters are DTensors."""

    def __init__(self, device: torch.device, *, reshard_after_forward: bool = True, **layout: Any):
        super().__init__(device, **layout)
        self.reshard_after_forward = reshard_after_forward
        # Each rank writes its own weight shards (torch.distributed.checkpoint); loading re-shards.
        self.checkpoint_io = ShardedStateIO(self)

    @property
    def distributed_type(self) -> str:
        return "FSDP"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.device)
        mesh = init_device_mesh(self.device.type, (self.num_processes,))
        for layer in _shard_units(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        # The root gathers whatever the layers do not own (embeddings' neighbours, norms, heads).
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return _gradient_sync(model, False)

    def force_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return _gradient_sync(model, True)

    def join(self, joinables: list[Any], enable: bool) -> AbstractContextManager[Any]:
        if enable:
            # Without Join support a rank that runs out of batches would leave the others waiting.
            raise NotImplementedError("join_uneven_inputs with uneven batches is not supported under FSDP2; "
                                      "keep even_batches=True.")
        return contextlib.nullcontext()

    def set_requires_gradient_sync(self, model: nn.Module, requires_sync: bool) -> None:
        if hasattr(model, "set_requires_gradient_sync"):
            cast(Any, model).set_requires_gradient_sync(requires_sync)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        # Gradients are sharded DTensors: the norm torch computes is already global; it comes back
        # as a DTensor, and callers expect a plain tensor.
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Gathered on rank 0 (a collective: every rank calls it); other ranks get ``{}``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own FSDP2 group, innermost first: a Transformers model's
    repeated blocks (``_no_split_modules``), else every parameter-heavy layer."""
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if block_names:
        units = [m for m in model.modules() if type(m).__name__ in block_names]
        if units:
            return units
    heavy = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [m for m in model.modules() if m is not model and isinstance(m, heavy)]


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, requires_sync: bool) -> Iterator[None]:
    if not hasattr(model, "set_requires_gradient_sync"):
        yield
        return
    fsdp_model = cast(Any, model)  # an FSDPModule: fully_shard swapped its class
    fsdp_model.set_requires_gradient_sync(requires_sync)
    try:
        yield
    finally:
        # Back to FSDP2's default: reduce-scatter in every backward.
        fsdp_model.set_requires_gradient_sync(True)
