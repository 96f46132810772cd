"""``hardware=fsdp``: FSDP2 (``fully_shard``) on nccl when GPUs are visible, else on gloo."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import ConfigError, HardwareConfig, RunConfig
from app.distributed.hardware.cuda import CUDA, gpu_count, require_gpu_per_process, visible_gpus
from app.distributed.hardware.device import CPU, DeviceOps
from app.distributed.hardware.multi_cpu import require_cores
from app.distributed.hardware.spec import Launched, MultiProcessSpec, Visible

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


class FsdpSpec(MultiProcessSpec):
    kind = "fsdp"
    devices = (CUDA, CPU)

    def probe(self) -> Visible:
        return visible_gpus()

    def device_type(self, visible: Visible) -> str:
        return _device_ops(visible).type

    def validate(self, cfg: RunConfig, visible: Visible, launched: Launched, multi_process_kinds: str) -> None:
        if cfg.trainer.ema_decay is not None:
            raise ConfigError("trainer.ema_decay does not work with hardware=fsdp yet (the average would be "
                              "sharded like the weights); use hardware=multi_cpu or multi_gpu, or ema_decay=null.")
        super().validate(cfg, visible, launched, multi_process_kinds)

    def check_layout(self, hw: HardwareConfig, visible: Visible) -> None:
        super().check_layout(hw, visible)
        if gpu_count(visible) > 0:
            require_gpu_per_process(hw, visible)
        else:
            require_cores(hw)

    def detects(self, world_size: int, cpu: bool) -> bool:
        return False  # only chosen by the config

    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.backends.torch_distributed import FSDPBackend

        return FSDPBackend.from_environment(_device_ops(self.probe()), timeout_s=hw.collective_timeout_s,
                                            reshard_after_forward=hw.fsdp_reshard_after_forward)


def _device_ops(visible: Visible) -> DeviceOps:
    """nccl on the GPUs when there are any, else gloo on the CPUs."""
    return CUDA if gpu_count(visible) > 0 else CPU
