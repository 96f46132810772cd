"""``hardware=tpu``: PyTorch/XLA through SPMD, one process per host driving all of its XLA devices
(TPU chips; XLA's CPU device with ``PJRT_DEVICE=CPU`` for tests). The backend is
``app/distributed/backends/xla_spmd.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import ConfigError, HardwareConfig, RunConfig
from app.distributed.hardware.spec import HardwareSpec, Launched, Visible
from app.distributed.hardware.xla import (
    NATIVE_NOTICES,
    XLA,
    bf16_variable_refusal,
    default_compile_cache_dir,
    xla_problem,
)

if TYPE_CHECKING:
    from app.distributed.backends.base import Backend


class TpuSpec(HardwareSpec):
    kind = "tpu"
    devices = (XLA,)
    native_notices = NATIVE_NOTICES
    native_source = "torch_xla"

    def check_devices(self, hw: HardwareConfig, visible: Visible) -> None:
        problem = xla_problem()
        if problem is not None:
            raise ConfigError(problem)

    def validate(self, cfg: RunConfig, visible: Visible, launched: Launched, multi_process_kinds: str) -> None:
        # Precision first: fp16, or bf16 through torch_xla's variables, is a config error whether or not
        # torch_xla is installed here.
        refusal = bf16_variable_refusal()
        if refusal is not None:
            raise ConfigError(refusal)
        self.check_precision(cfg.precision.mode, visible)
        super().validate(cfg, visible, launched, multi_process_kinds)

    def detects(self, world_size: int, cpu: bool) -> bool:
        """XLA wherever it can run (a TPU, or PJRT_DEVICE set), for one process; and for a process
        count asked for outside any launcher (``notebook_launcher(num_processes=8)``, as on
        Accelerate's TPU path): SPMD drives every device from this one process."""
        if cpu or xla_problem() is not None:
            return False
        return world_size == 1 or "WORLD_SIZE" not in os.environ

    def build_backend(self, hw: HardwareConfig) -> Backend:
        from app.distributed.backends.xla_spmd import XlaSpmdBackend

        cache = Path(hw.compile_cache_dir).expanduser() if hw.compile_cache_dir else default_compile_cache_dir()
        return XlaSpmdBackend(sharding=hw.sharding, compile_cache_dir=cache)
