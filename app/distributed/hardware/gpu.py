"""``hardware=gpu``: one process on the first CUDA device."""

from __future__ import annotations

from app.config import HardwareConfig
from app.distributed.hardware.cuda import CUDA, require_gpu, visible_gpus
from app.distributed.hardware.spec import HardwareSpec, Visible


class GpuSpec(HardwareSpec):
    kind = "gpu"
    devices = (CUDA,)

    def probe(self) -> Visible:
        return visible_gpus()

    def check_devices(self, hw: HardwareConfig, visible: Visible) -> None:
        require_gpu(hw, visible)

    def detects(self, world_size: int, cpu: bool) -> bool:
        return world_size == 1 and not cpu and visible_gpus()["cuda"] > 0
