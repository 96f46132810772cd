"""Accelerate's functional operations (``from accelerate.utils import gather``), acting on the live
process group (see ``state.py``). The ``Accelerator`` methods of the same names do the same on that
Accelerator's own backend.

With ``PartialState().debug = True`` (or ``ACCELERATE_DEBUG_MODE=1``) every operation first checks
that all processes passed tensors of compatible shapes, and raises
:class:`DistributedOperationException` naming them instead of hanging or corrupting data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from app.distributed.backends.base import Backend
from app.distributed.operations import recursively_apply, send_to_device
from app.distributed.state import debug_mode, live_backend

_REDUCE_OPS = ("sum", "mean", "max", "min")


class DistributedOperationException(Exception):
    """Processes called a collective with incompatible inputs."""


def _shapes(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data, error_on_other=False)


def _verify(backend: Backend, name: str, data: Any, same_rank_only: bool = False) -> None:
    if backend.num_processes == 1 or not debug_mode():  # the cheap test first: this runs every log step
        return
    shapes = backend.all_gather_object(_shapes(data))
    if same_rank_only:
        ranks = [[len(s) for s in _leaves(shape)] for shape in shapes]
        ok = all(r == ranks[0] for r in ranks)
    else:
        ok = all(s == shapes[0] for s in shapes)
    if not ok:
        listing = "\n".join(f"  - process {i}: {s}" for i, s in enumerate(shapes))
        raise DistributedOperationException(
            f"cannot apply {name}: the processes passed tensors of incompatible shapes:\n{listing}")


def _leaves(shape: Any) -> list[Any]:
    if isinstance(shape, Mapping):
        return [leaf for v in shape.values() for leaf in _leaves(v)]
    if isinstance(shape, (list, tuple)) and shape and not all(isinstance(x, int) for x in shape):
        return [leaf for v in shape for leaf in _leaves(v)]
    return [shape]


def gather(tensor: Any) -> Any:
    """Concatenate tensors (or nested structures of them) from all processes along dim 0."""
    backend = live_backend()
    return recursively_apply(backend.all_gather, tensor)


def gather_object(obj: Any) -> list[Any]:
    """Gather picklable objects: lists are concatenated in process order, other objects collected
    one per process."""
    gathered = live_backend().all_gather_object(obj)
    if isinstance(obj, (list, tuple)):
        return [item for part in gathered for item in part]
    return gathered


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (same shapes on every process)."""
    backend = live_backend()
    _verify(backend, "broadcast", tensor)
    return recursively_apply(lambda t: backend.broadcast(t, from_process), tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the list's items, in place, by ``from_process``'s (pickled); returns the list."""
    received = live_backend().broadcast_object(list(object_list), src=from_process)
    object_list[:] = received
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce across processes with ``sum``, ``mean``, ``max`` or ``min`` (Accelerate's default here is
    ``mean``; ``Accelerator.reduce``'s is ``sum``, as in Accelerate)."""
    return reduce_with(live_backend(), tensor, reduction, scale)


def reduce_with(backend: Backend, tensor: Any, reduction: str, scale: float) -> Any:
    if reduction not in _REDUCE_OPS:
        raise ValueError(f"reduction must be one of {_REDUCE_OPS}, got {reduction!r}.")
    _verify(backend, "reduce", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        out = backend.all_reduce(t, reduction)
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad tensors along ``dim`` to the largest size any process has, so they can be gathered."""
    return pad_with(live_backend(), tensor, dim, pad_index, pad_first)


def pad_with(backend: Backend, tensor: Any, dim: int, pad_index: int, pad_first: bool) -> Any:
    _verify(backend, "pad_across_processes", tensor, same_rank_only=True)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or dim >= t.dim():
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        max_size = int(backend.all_reduce(size, "max").item())
        if max_size == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = max_size
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.dim()
        index[dim] = slice(max_size - t.shape[dim], max_size) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out

    return recursively_apply(pad, tensor)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The main process's tensor on every process (the others pass ``None``)."""
    backend = live_backend()
    meta = backend.broadcast_object((tuple(tensor.shape), tensor.dtype) if tensor is not None else None, src=0)
    shape, dtype = meta
    buffer = tensor if tensor is not None else torch.zeros(shape, dtype=dtype, device=backend.device)
    return backend.broadcast(buffer.to(backend.device), 0)


def synchronize_rng_state(rng_type: str, generator: torch.Generator | None = None) -> None:
    """Give every process the main process's state of one random generator."""
    backend = live_backend()
    if backend.num_processes == 1:
        return
    if rng_type == "torch":
        torch.set_rng_state(backend.broadcast(torch.get_rng_state(), 0))
    elif rng_type == backend.ops.type:  # the accelerator's own generators (DeviceOps knows how)
        backend.ops.set_rng_state(backend.broadcast_object(backend.ops.rng_state(), 0))
    elif rng_type == "generator":
        if generator is None:
            raise ValueError("synchronize_rng_states(['generator']) needs the generator=... to synchronise.")
        generator.set_state(backend.broadcast(generator.get_state(), 0))
    else:
        raise ValueError(f"cannot synchronise the {rng_type!r} random generator on this backend "
                         f"(supported: torch, generator, {backend.ops.type}).")


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    for rng_type in rng_types:
        synchronize_rng_state(str(getattr(rng_type, "value", rng_type)), generator)


__all__ = ["DistributedOperationException", "broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather",
           "gather_object", "pad_across_processes", "reduce", "send_to_device", "synchronize_rng_state",
           "synchronize_rng_states"]
