"""The one place where a hardware kind from the config becomes a backend object."""

from __future__ import annotations

import torch

from app.config import HardwareConfig, HardwareKind
from app.distributed.backend import Backend


def build_backend(hw: HardwareConfig) -> Backend:
    """Map the hardware kind to its backend object (one class per kind)."""
    if hw.kind is HardwareKind.cpu:
        return Backend(torch.device("cpu"))
    if hw.kind is HardwareKind.gpu:
        return Backend(torch.device("cuda", 0))
    from app.distributed.torch_distributed import DDPBackend, FSDPBackend

    timeout = hw.collective_timeout_s
    if hw.kind is HardwareKind.multi_cpu:
        return DDPBackend.from_environment(cpu=True, timeout_s=timeout)
    if hw.kind is HardwareKind.multi_gpu:
        return DDPBackend.from_environment(cpu=False, timeout_s=timeout)
    if hw.kind is HardwareKind.fsdp:
        return FSDPBackend.from_environment(cpu=not torch.cuda.is_available(), timeout_s=timeout,
                                            reshard_after_forward=hw.fsdp_reshard_after_forward)
    raise ValueError(f"no backend for hardware kind {hw.kind}")
