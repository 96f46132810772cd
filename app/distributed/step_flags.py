"""``any process raised it?`` once per optimizer step, without stalling the step: what the loop asks to
stop every rank after the same step when a signal reached only some of them.

:class:`LaggedFlag` starts this step's OR of a boolean as an asynchronous collective on a host (CPU)
tensor and reads the previous step's, which has completed meanwhile: no host sync on the training
device and, in the common case, no wait. Every rank reads the same result at the same step, so all
stop after the same step (one step after the first rank raised it). :class:`SyncFlag` is the fallback
for backends without an asynchronous host collective: one blocking OR per step (the identity on one
process).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class StepFlag(Protocol):
    def post(self, raised: bool) -> bool:
        """Give this step's value; True on every process once some process raised it (at the same
        step on all of them)."""
        ...

    def close(self) -> None:
        """Finish any collective still in flight (every process calls it after the same step)."""
        ...


class SyncFlag:
    """One blocking all-reduce per step (``any_raised(value) -> bool`` does it)."""

    def __init__(self, any_raised: Any):
        self._any_raised = any_raised

    def post(self, raised: bool) -> bool:
        return bool(self._any_raised(raised))

    def close(self) -> None:
        pass


class LaggedFlag:
    """This step's OR started asynchronously on ``group`` (a process group for host tensors); the
    previous step's returned."""

    def __init__(self, group: Any = None):
        self._group = group
        self._pending: tuple[Any, torch.Tensor] | None = None

    def post(self, raised: bool) -> bool:
        import torch.distributed as dist

        previous = self._result()
        flag = torch.tensor([1 if raised else 0], dtype=torch.uint8)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)
        return previous

    def close(self) -> None:
        self._result()

    def _result(self) -> bool:
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()  # started a step ago: normally complete already
        return bool(flag.item())
