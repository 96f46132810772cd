"""``hardware=multi_cpu``: DDP on gloo, one process per CPU worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import HardwareConfig
from app.distributed.hardware.cuda import visible_gpus
from app.distributed.hardware.spec import MultiProcessSpec

if TYPE_CHECKING:
    from app.distributed.backend import Backend


class MultiCpuSpec(MultiProcessSpec):
    kind = "multi_cpu"

    def detects(self, world_size: int, cpu: bool) -> bool:
        return world_size > 1 and (cpu or visible_gpus()["cuda"] == 0)

    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.torch_distributed import DDPBackend

        return DDPBackend.from_environment(self.devices[0], timeout_s=hw.collective_timeout_s)
