"""What the runtime does differently per torch device type, with the CPU's behaviour as the default.

A backend owns one of these (``Backend.ops``, looked up from its device's type): checkpoints ask it
for the device's RNG state, ``Accelerator.free_memory`` for releasing cached memory, the optimizer
wrapper for the end-of-step hook, the precision factory for what the device can run, and the
multi-process backends for the collective library. A device type with different needs (CUDA in
``cuda.py``) subclasses it; a kind's spec lists the device types it may run on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from app.distributed.host_reads import HostRead, ReadNow


class DeviceOps:
    """Device-type-specific operations; this base class is the CPU's (nothing beyond torch's RNG)."""

    type: str = "cpu"
    """The ``torch.device`` type these operations are for."""
    collective_backend: str = "gloo"
    """What ``torch.distributed.init_process_group`` gets for processes on this device type."""
    precisions: frozenset[str] = frozenset({"no", "bf16"})
    """The ``mixed_precision`` modes this device runs."""
    fused_optimizers: bool = True
    """Whether torch's fused optimizer kernels (``AdamW(fused=True)``) run on this device's parameters
    (on CPU one fused AdamW step is ~7x faster than torch's default per-parameter loop)."""
    hub_kernels: bool = True
    """Whether the Hugging Face ``kernels`` library (transformers' Hub kernels, opt-in in the app:
    ``app/launching/hub_kernels.py``) runs on this device type."""
    pinned_memory: bool = False
    """Whether host buffers for copies from this device may be pinned (page-locked), so that the copy
    runs at full bus speed (an asynchronous checkpoint's copy of the state)."""

    def local_device(self, local_rank: int) -> torch.device:
        """The device of the process with this local rank (and make it the current one)."""
        return torch.device(self.type)

    def precision_refusal(self, mode: str) -> str | None:
        """The one sentence refusing ``mode`` (a ``mixed_precision`` / ``precision=`` value) on this
        device type, or None when it runs here (it is in :attr:`precisions`). Both the config's check
        (``HardwareSpec.check_precision``) and ``build_precision`` (an ``Accelerator``) say it."""
        if mode in self.precisions:
            return None
        return f"precision={mode} needs a CUDA GPU (loss scaling on CPU is not supported); use bf16 or no."

    def rng_state(self) -> dict[str, Any]:
        """The device's RNG states, stored next to python/numpy/torch in ``rng_state_<rank>``; the
        keys are part of the checkpoint format."""
        return {}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`rng_state` captured; keys this device does not know are ignored (a
        checkpoint written on another device type)."""

    def device_name(self, device: torch.device) -> str | None:
        """The chip's name as the device reports it (``NVIDIA H100 80GB HBM3``, ``TPU v5 lite``), by
        which ``peak_flops`` finds its peak; None where it has none to report (a CPU)."""
        return None

    def free_memory(self) -> None:
        """Release memory the device's allocator caches."""

    def step_end(self) -> None:
        """Called once after every real optimizer step: a lazy device cuts its graph here."""

    reads_lag: bool = False
    """Whether :meth:`read_async` returns before the values are in (the device runs ahead of the host):
    the loop then asks for them one optimizer step later (``app/distributed/host_reads.py``)."""

    def read_async(self, tensors: Sequence[torch.Tensor]) -> HostRead:
        """Start reading scalars of this device on the host; the CPU reads them at once."""
        return ReadNow(tensors)


CPU = DeviceOps()
