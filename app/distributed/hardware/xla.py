"""PyTorch/XLA: the XLA device's operations (RNG seed, graph cut, what precisions it runs) and the
checks that say, in one sentence, why it cannot run here. Nothing here imports ``torch_xla`` until an
operation needs it, so the application loads without it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from app.distributed.hardware.device import DeviceOps
from app.distributed.host_reads import HostRead

INSTALL_HINT = ("hardware=tpu needs PyTorch/XLA, which is not installed here; torch_xla 2.9.0 needs torch 2.9.0 "
                "exactly, so make a separate environment for it rather than changing this one's torch: "
                "python3 -m venv .venv-xla && .venv-xla/bin/pip install torch==2.9.0 torch_xla==2.9.0 && "
                '.venv-xla/bin/pip install -e ".[tpu]" (docs/tpu.md).')
NO_TPU_HINT = ("hardware=tpu found no TPU on this machine; run on a TPU VM, or set PJRT_DEVICE=CPU to run on "
               "XLA's CPU device (slow, for testing).")
_GOOGLE_PCI_VENDOR = "0x1ae0"
NATIVE_NOTICES = (
    # XLA's partitioner, at every graph it compiles: torch_xla 2.9's SPMD runs on GSPMD, which nobody using
    # torch_xla can swap for Shardy.
    "GSPMD sharding propagation is going to be deprecated",
    # The persistent compile cache, at every graph, on XLA:CPU, which cannot load executables: the graph is
    # compiled again, and the run's closing XLA line counts those ("found there").
    "Failed to deserialize executable",
)
"""What torch_xla's C++ runtime writes to stderr that says nothing to a user (``HardwareSpec.native_notices``)."""
BF16_VARIABLES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")
"""torch_xla's deprecated switches that store every float tensor in bf16."""


def bf16_variable_refusal() -> str | None:
    """The one sentence refusing XLA_USE_BF16 / XLA_DOWNCAST_BF16 when set, or None. They turn every
    float tensor of the process into bf16 (the weights and the optimizer state too, so small updates
    are lost), behind the precision setting's back: bf16 here is autocast, chosen by precision=bf16."""
    for name in BF16_VARIABLES:
        if os.environ.get(name, "").strip().lower() not in ("", "0", "false"):
            return (f"{name} is set, which makes torch_xla keep every float tensor (weights and optimizer state "
                    f"too) in bf16; unset it and use precision=bf16, which computes in bf16 under autocast and "
                    f"keeps the weights in fp32.")
    return None


def default_compile_cache_dir() -> Path:
    """``hardware.compile_cache_dir`` left null: ``xla_cache`` in the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "app" / "xla_cache"


def xla_problem() -> str | None:
    """Why XLA cannot run here (one sentence), or None. Cheap: imports nothing."""
    if importlib.util.find_spec("torch_xla") is None:
        return INSTALL_HINT
    if "PJRT_DEVICE" not in os.environ and not tpu_attached():
        # Left alone, torch_xla would quietly fall back to its CPU device: say so instead.
        return NO_TPU_HINT
    return None


def tpu_attached() -> bool:
    """A Google PCI device: what torch_xla looks for before it chooses PJRT_DEVICE=TPU itself."""
    for vendor in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor.read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


class XlaOps(DeviceOps):
    type = "xla"
    collective_backend = "gloo"  # between hosts, for objects; device tensors need none under SPMD
    precisions = frozenset({"no", "bf16"})
    fused_optimizers = False  # torch's fused kernels exist for CPU and CUDA only
    hub_kernels = False  # kernels' kernelize() raises "Unsupported device type 'xla'"
    reads_lag = True

    def local_device(self, local_rank: int) -> torch.device:
        import torch_xla

        return torch_xla.device()

    def precision_refusal(self, mode: str) -> str | None:
        if mode in self.precisions:
            return None
        return (f"precision={mode} does not run on hardware=tpu (XLA has no fp16 loss scaling here); use "
                "precision=bf16 or precision=no.")

    def device_name(self, device: torch.device) -> str | None:
        """PJRT's device kind (``TPU v4``, ``TPU v5 lite``; XLA's CPU device: ``cpu``)."""
        import torch_xla.core.xla_model as xm

        try:
            return str(xm.xla_device_kind(device))
        except (RuntimeError, AttributeError):
            return None

    def seed(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)

    def rng_state(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        # The device's 64-bit seed as a 0-d int64 tensor (the checkpoint format stores tensors, not
        # big ints): the same bits, read back below.
        seed = int(xm.get_rng_state())
        return {"xla": torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        if "xla" not in state:
            return  # written on another device type: that RNG does not continue here
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]) % 2**64)

    def free_memory(self) -> None:
        """XLA frees a device buffer when its last tensor dies; there is no cache to empty."""

    def step_end(self) -> None:
        """One graph cut per optimizer step: everything traced since the last cut compiles (once per
        distinct graph) and runs."""
        import torch_xla

        torch_xla.sync()

    def read_async(self, tensors: Sequence[torch.Tensor]) -> HostRead:
        return LaunchedRead(tensors)


class LaunchedRead:
    """The tensors themselves, outputs of a graph already launched (the optimizer step's
    ``torch_xla.sync()``): the transfer, when asked, waits for that graph only. Copies would be new
    graph outputs, computed with the next step, and the read would wait for that step."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = tuple(tensors)

    def result(self) -> tuple[float, ...]:
        """All the values in one transfer (the window's loss, items and a task's metrics: one wait, not
        one ``.item()`` sync each)."""
        import torch_xla

        fetch = getattr(torch_xla._XLAC, "_xla_get_cpu_tensors", None)
        if fetch is None:  # a torch_xla without it: one read each
            return tuple(t.item() for t in self.tensors)
        return tuple(t.item() for t in fetch(list(self.tensors)))


XLA = XlaOps()
