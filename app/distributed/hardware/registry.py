"""The only place where a ``hardware=`` option becomes objects: each kind's value maps to its spec.

Adding a kind is one file with its :class:`~app.distributed.hardware.spec.HardwareSpec` subclass
(and its :class:`~app.distributed.hardware.device.DeviceOps` if it brings a new device type), one line
in :data:`SPECS`, one ``conf/hardware/<kind>.yaml`` and the value in ``app.config.HardwareKind``
(the Enum lets Hydra reject an unknown option when the config is composed; a test checks that the
Enum and this table agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from app.distributed.hardware.cpu import CpuSpec
from app.distributed.hardware.device import CPU, DeviceOps
from app.distributed.hardware.fsdp import FsdpSpec
from app.distributed.hardware.gpu import GpuSpec
from app.distributed.hardware.multi_cpu import MultiCpuSpec
from app.distributed.hardware.multi_gpu import MultiGpuSpec
from app.distributed.hardware.spec import HardwareSpec
from app.distributed.hardware.tpu import TpuSpec

if TYPE_CHECKING:
    from app.config import HardwareConfig
    from app.distributed.backends.base import Backend

SPECS: dict[str, HardwareSpec] = {
    # Also the order in which an Accelerator() without a config asks HardwareSpec.detects: "cpu",
    # which takes any single process, stays last.
    "tpu": TpuSpec(),
    "multi_cpu": MultiCpuSpec(),
    "multi_gpu": MultiGpuSpec(),
    "fsdp": FsdpSpec(),
    "gpu": GpuSpec(),
    "cpu": CpuSpec(),
}


def hardware_spec(kind: Any) -> HardwareSpec:
    """The spec of a :class:`~app.config.HardwareKind` (or of its value)."""
    value = getattr(kind, "value", kind)
    if value not in SPECS:
        raise ValueError(f"no hardware spec for kind {value!r}; known: {', '.join(SPECS)}.")
    return SPECS[value]


def build_backend(hw: HardwareConfig) -> Backend:
    """The backend object of a run's hardware config (joins the process group on multi-process kinds)."""
    return hardware_spec(hw.kind).build_backend(hw)


def device_ops(device: torch.device | str) -> DeviceOps:
    """The operations of a torch device type, from the kinds that run on it; the CPU's for a type no
    kind declares (e.g. ``meta``)."""
    device_type = device.type if isinstance(device, torch.device) else device
    for spec in SPECS.values():
        for ops in spec.devices:
            if ops.type == device_type:
                return ops
    return CPU


def detect_spec(world_size: int, cpu: bool) -> HardwareSpec:
    """The kind an ``Accelerator()`` without a config runs on here (the first whose ``detects`` agrees)."""
    for spec in SPECS.values():
        if spec.detects(world_size, cpu):
            return spec
    return SPECS["cpu"]


def multi_process_kinds() -> str:
    """``multi_cpu, multi_gpu or fsdp``: the kinds to suggest when a config asks for several processes."""
    names = [kind for kind, spec in SPECS.items() if spec.multi_process]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
