"""Numeric precision as one object: autocast context, loss scaling, and the optimizer step.

The choice is made once, when the runtime is built; the loop never branches on a precision name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from app.distributed.configuration import AutocastKwargs


def convert_to_fp32(obj: Any) -> Any:
    """Cast floating-point tensors in (nested) outputs back to fp32, so a loss computed outside the
    model (e.g. ``cross_entropy(model(x), y)``) is not computed in half precision."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):  # includes transformers' ModelOutput, which we update in place
        for key in list(obj.keys()):
            obj[key] = convert_to_fp32(obj[key])
        return obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(convert_to_fp32(o) for o in obj)
    return obj


class Precision:
    """Full precision: no autocast, no scaling."""

    name = "no"
    scales_loss = False
    """Whether the loss (hence the gradients) is scaled and must be unscaled before clipping."""

    def autocast(self, handler: AutocastKwargs | None = None) -> AbstractContextManager[Any]:
        """The autocast context (``handler``: torch.autocast's switches); full precision has none."""
        return contextlib.nullcontext()

    def wrap_forward(self, forward: Callable[..., Any], handler: AutocastKwargs | None = None) -> Callable[..., Any]:
        """``forward`` run in the autocast context, its outputs in fp32 (unchanged in full precision)."""
        return forward

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make gradients true-valued before clipping (a no-op without loss scaling)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> bool:
        """Step the optimizer; returns False when the step was skipped (fp16 overflow)."""
        optimizer.step(closure) if closure is not None else optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AutocastPrecision(Precision):
    """Mixed precision through ``torch.autocast``; weights stay fp32, matmuls run in ``dtype``."""

    def __init__(self, name: str, device_type: str, dtype: torch.dtype):
        self.name = name
        self.device_type = device_type
        self.dtype = dtype

    def autocast(self, handler: AutocastKwargs | None = None) -> AbstractContextManager[Any]:
        options = handler.autocast_arguments() if handler is not None else {}
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **options)

    def wrap_forward(self, forward: Callable[..., Any], handler: AutocastKwargs | None = None) -> Callable[..., Any]:
        device_type, dtype = self.device_type, self.dtype
        options = handler.autocast_arguments() if handler is not None else {}

        def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=dtype, **options):
                out = forward(*args, **kwargs)
            return convert_to_fp32(out)

        forward_in_autocast.__wrapped__ = forward  # type: ignore[attr-defined]
        return forward_in_autocast


class Fp16Precision(AutocastPrecision):
    """fp16 autocast plus dynamic loss scaling; an overflowing step is skipped and reported."""

    scales_loss = True

    def __init__(self, device_type: str):
        super().__init__("fp16", device_type, torch.float16)
        self.scaler = torch.amp.GradScaler(device_type)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # GradScaler remembers which optimizers it already unscaled this step; asking twice is an error.
        from torch.amp.grad_scaler import OptState

        if self.scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> bool:
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() lowers the scale exactly when this step found inf/nan gradients and skipped.
        return not self.scaler.get_scale() < scale_before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def build_precision(mode: str, device: torch.device) -> Precision:
    """Map a precision name (``no``/``fp16``/``bf16``) to its object for the given device."""
    if mode in ("no", None):
        return Precision()
    if mode not in ("bf16", "fp16"):
        raise ValueError(f"unknown mixed precision {mode!r}; expected 'no', 'fp16' or 'bf16'.")
    from app.distributed.hardware import device_ops

    refusal = device_ops(device).precision_refusal(mode)  # what the device type runs (app/distributed/hardware/)
    if refusal is not None:
        raise ValueError(refusal)
    if mode == "bf16":
        return AutocastPrecision("bf16", device.type, torch.bfloat16)
    return Fp16Precision(device.type)


def unscale_all(precision: Precision, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        precision.unscale_(optimizer)
