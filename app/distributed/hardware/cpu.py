"""``hardware=cpu``: one process on the CPU (the base spec as it is)."""

from __future__ import annotations

from app.distributed.hardware.spec import HardwareSpec


class CpuSpec(HardwareSpec):
    kind = "cpu"
