"""Item-normalised gradients, behind ``Accelerator.backward(loss, num_items=n)`` (ours, not Accelerate's).

A loss that is a *sum* over items (a language model's predicted tokens, a classifier's samples) is
back-propagated as it is and its items are counted. Once the micro-batch that closes an optimizer
step has been back-propagated, the step's item count is summed across processes (one all-reduce of a
scalar per optimizer step; no host read) and the gradients are divided by it, times the number of
processes whose gradients the backend averages (DDP and FSDP2 divide by it; that undoes their mean).
The result is the gradient of the mean loss over every item of the step, whatever its split over
micro-batches and processes: the rule the HF Trainer adopted in October 2024 (``num_items_in_batch``,
transformers PR #34191) after a token in a short micro-batch had been found to weigh more than one in
a long one.

A step of a single micro-batch (no accumulation) divides the loss instead of the gradients, before
its backward: no pass over the gradients at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.distributed.backends.base import Backend


class StepItems:
    """The items back-propagated since the last optimizer step, on the host (counts given as ints) and
    on the device (counts given as tensors, summed there)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.on_host = 0
        self.on_device: torch.Tensor | None = None
        self.empty = True
        """No micro-batch of this step has been counted yet."""

    def add(self, num_items: torch.Tensor | int) -> None:
        if isinstance(num_items, torch.Tensor):
            items = num_items.detach()
            self.on_device = items if self.on_device is None else self.on_device + items
        else:
            self.on_host += int(num_items)
        self.empty = False

    def take_scale(self) -> torch.Tensor | float:
        """What the step's summed loss (or its gradients) is multiplied by: the backend's gradient
        replicas over the step's items on every process (at least one item, so a step whose items were
        all masked leaves its zero gradients at zero). The next step's count starts empty."""
        on_host, on_device = self.on_host, self.on_device
        self.on_host, self.on_device, self.empty = 0, None, True
        replicas = self.backend.gradient_replicas
        if replicas == 1 and on_device is None:
            return 1.0 / max(on_host, 1)  # one process (or a global SPMD batch) counted on the host: no device op
        total = on_device + on_host if on_device is not None else torch.tensor(on_host, device=self.backend.device)
        if replicas > 1:
            # Each process back-propagated its own batch: the step's items are all processes' items.
            total = self.backend.all_reduce(total, "sum")
        return replicas / total.clamp(min=1)


def scale_gradients(gradients: Sequence[torch.Tensor], scale: torch.Tensor | float) -> None:
    """Multiply every gradient by ``scale`` in place (one fused kernel per device where torch has it;
    FSDP2's sharded gradients are scaled shard by shard)."""
    if gradients:
        torch._foreach_mul_(list(gradients), scale)
