"""``hardware=multi_cpu``: DDP on gloo, one process per CPU worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import ConfigError, HardwareConfig
from app.distributed.hardware.cuda import visible_gpus
from app.distributed.hardware.spec import MultiProcessSpec, Visible
from app.this_process import available_cores

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


def require_cores(hw: HardwareConfig) -> None:
    """One CPU process per core at most: beyond that they only take turns (3 steps took minutes)."""
    cores = available_cores()
    if hw.num_processes > cores:
        raise ConfigError(
            f"hardware.num_processes={hw.num_processes} asks for more CPU processes than the {cores} core(s) this "
            f"machine gives the run; use hardware.num_processes={cores} or fewer.")


class MultiCpuSpec(MultiProcessSpec):
    kind = "multi_cpu"

    def check_layout(self, hw: HardwareConfig, visible: Visible) -> None:
        super().check_layout(hw, visible)
        require_cores(hw)

    def detects(self, world_size: int, cpu: bool) -> bool:
        return world_size > 1 and (cpu or visible_gpus()["cuda"] == 0)

    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.backends.torch_distributed import DDPBackend

        return DDPBackend.from_environment(self.devices[0], timeout_s=hw.collective_timeout_s)
