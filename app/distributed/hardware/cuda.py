"""CUDA: the device operations of the GPU kinds (``gpu``, ``multi_gpu``, ``fsdp`` on GPUs) and the
helpers their specs share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from app.config import ConfigError, HardwareConfig
from app.distributed.hardware.device import DeviceOps
from app.distributed.host_reads import HostRead


class CudaOps(DeviceOps):
    type = "cuda"
    # CUDA tensors go through nccl; CPU tensors (pickled objects, CPU metrics) through gloo.
    collective_backend = "cpu:gloo,cuda:nccl"
    precisions = frozenset({"no", "bf16", "fp16"})
    pinned_memory = True
    reads_lag = True

    def local_device(self, local_rank: int) -> torch.device:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device

    def rng_state(self) -> dict[str, Any]:
        return {"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def device_name(self, device: torch.device) -> str | None:
        return torch.cuda.get_device_name(device) if torch.cuda.is_available() else None

    def free_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def read_async(self, tensors: Sequence[torch.Tensor]) -> HostRead:
        return PinnedCopy(tensors)


class PinnedCopy:
    """Each tensor copied into pinned host memory on the current stream, then an event recorded: the
    result waits for that event only, not for the kernels queued after it."""

    __slots__ = ("copies", "event")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       for t in tensors]
        self.event = torch.cuda.Event()
        self.event.record()

    def result(self) -> tuple[float, ...]:
        self.event.synchronize()
        return tuple(c.item() for c in self.copies)


CUDA = CudaOps()


def visible_gpus() -> dict[str, int]:
    """What the GPU specs check a config against (tests pass their own mapping instead)."""
    return {"cuda": torch.cuda.device_count()}


def gpu_count(visible: Mapping[str, int]) -> int:
    return visible.get("cuda", 0)


def require_gpu(hw: HardwareConfig, visible: Mapping[str, int]) -> None:
    if gpu_count(visible) == 0:
        raise ConfigError(f"hardware={hw.kind.value} needs a CUDA GPU, but none is visible; use hardware=cpu.")


def require_gpu_per_process(hw: HardwareConfig, visible: Mapping[str, int]) -> None:
    if hw.num_processes > gpu_count(visible):
        raise ConfigError(
            f"hardware.num_processes={hw.num_processes} asks for more GPUs than the {gpu_count(visible)} visible."
        )
