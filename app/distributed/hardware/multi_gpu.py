"""``hardware=multi_gpu``: DDP on nccl, one process per CUDA device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import HardwareConfig
from app.distributed.hardware.cuda import CUDA, require_gpu, require_gpu_per_process, visible_gpus
from app.distributed.hardware.spec import MultiProcessSpec, Visible

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


class MultiGpuSpec(MultiProcessSpec):
    kind = "multi_gpu"
    devices = (CUDA,)

    def probe(self) -> Visible:
        return visible_gpus()

    def check_devices(self, hw: HardwareConfig, visible: Visible) -> None:
        require_gpu(hw, visible)

    def check_layout(self, hw: HardwareConfig, visible: Visible) -> None:
        super().check_layout(hw, visible)
        require_gpu_per_process(hw, visible)

    def detects(self, world_size: int, cpu: bool) -> bool:
        return world_size > 1 and not cpu and visible_gpus()["cuda"] > 0

    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.backends.torch_distributed import DDPBackend

        return DDPBackend.from_environment(CUDA, timeout_s=hw.collective_timeout_s)
