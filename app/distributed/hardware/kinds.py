"""Accelerate's enums naming hardware kinds and random generators (they name device types, so they
live in the hardware package). ``Backend.distributed_type`` returns one of these values."""

from __future__ import annotations

import enum


class DistributedType(str, enum.Enum):
    """How the processes share the work (Accelerate's values). A ``str`` enum, so comparing with the
    plain strings ``"MULTI_CPU"`` etc. keeps working."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"

    def __str__(self) -> str:
        return self.value


class RNGType(str, enum.Enum):
    TORCH = "torch"
    CUDA = "cuda"
    XLA = "xla"
    GENERATOR = "generator"
