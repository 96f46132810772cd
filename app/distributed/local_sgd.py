"""Local SGD: each process takes optimizer steps on its own gradients (no all-reduce in backward)
and every ``local_sgd_steps`` steps the processes average their parameters (one all-reduce per
parameter). Fewer, larger synchronisations than DDP; the models agree only at those points.

>>> with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
...     for batch in loader:
...         with accelerator.accumulate(model):
...             accelerator.backward(model(batch).loss)
...             optimizer.step(); optimizer.zero_grad()
...             local_sgd.step()
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch import nn

from app.distributed.hardware.kinds import DistributedType

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    def __init__(self, accelerator: Any, model: nn.Module, local_sgd_steps: int, enabled: bool = True):
        if local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps must be >= 1, got {local_sgd_steps}.")
        if enabled and accelerator.distributed_type not in _SUPPORTED:
            raise NotImplementedError(f"LocalSGD needs DDP or a single process, not {accelerator.distributed_type}.")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:  # noqa: PYI034
        if self.enabled:
            # Gradients stay local: the backward all-reduce is what local SGD saves.
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.enabled:
            self._sync_and_avg_model_params()
        self._no_sync.close()

    def step(self) -> None:
        """Call after each optimizer step; averages the parameters every ``local_sgd_steps`` calls."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        backend = self.accelerator.backend
        for param in self.accelerator.unwrap_model(self.model).parameters():
            param.data.copy_(backend.all_reduce(param.data, "mean"))
