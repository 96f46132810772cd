"""An exponential moving average of the trained weights (``trainer.ema_decay``).

After every optimizer step: ``average = d * average + (1 - d) * weights``. Evaluation and the final
export use the average; training continues on the raw weights. Late in fine-tuning the raw weights
wander around a minimum from one mini-batch to the next; their average sits nearer its centre and
usually generalises better (Polyak averaging, as timm's ``ModelEmaV3`` and Lightning's weight
averaging do).

The effective decay warms up as ``min(d, (1 + n) / (10 + n))`` after n updates, so the first
updates are not anchored to the starting weights for ~1 / (1 - d) steps.

Only trainable parameters are averaged (buffers such as BatchNorm statistics stay as trained). The
average lives next to the weights, on their device and in their dtype, and is saved with every
checkpoint (it is registered like any ``state_dict`` object), so a resumed run continues it exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.average = [p.detach().clone() for p in self.params]
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in; call after each optimizer step."""
        weight = 1.0 - self.current_decay()
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], weight)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block and its trained weights again after it."""
        trained = [p.detach().clone() for p in self.params]
        torch._foreach_copy_([p.detach() for p in self.params], self.average)
        try:
            yield
        finally:
            torch._foreach_copy_([p.detach() for p in self.params], trained)

    @torch.no_grad()
    def take_weights(self) -> None:
        """The average becomes the model's weights as they are: the export loaded an evaluation's
        averaged weights into the model (``app.engine.best_weights``), which :meth:`applied` must keep."""
        torch._foreach_copy_(self.average, [p.detach() for p in self.params])

    def state_dict(self) -> dict[str, Any]:
        return {"average": list(self.average), "updates": self.updates, "decay": self.decay}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        average = state["average"]
        if len(average) != len(self.average) or any(a.shape != b.shape for a, b in zip(average, self.average)):
            raise ValueError("the saved weight average does not match this model's trainable parameters")
        torch._foreach_copy_(self.average, [a.to(b.device, b.dtype) for a, b in zip(average, self.average)])
        self.updates = int(state["updates"])
