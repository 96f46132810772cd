"""Reading device scalars on the host without stalling the device: how the loop reads its training
loss (and token count) at a log step.

Reading a value the device is still computing makes the host wait until the device has caught up
with everything queued before it; the device then idles while the host prepares the next step. Where
the device runs ahead of the host (CUDA, XLA), ``DeviceOps.read_async`` starts the transfer now and
its :meth:`HostRead.result` is asked one optimizer step later, by when the value is in and the device
is busy with the next step (the device types' own readers are in ``app/distributed/hardware/``). On
the CPU nothing runs ahead of the host: :class:`ReadNow` reads the values at once, and the caller asks
for them at once.

The tensors handed over are the reader's: the caller must not modify them afterwards (start a new
running sum instead of zeroing the old one; on XLA an in-place change would make the read wait for
the graph that computes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class HostRead(Protocol):
    def result(self) -> tuple[float, ...]:
        """The values, in the order given; waits for their transfer if it is not complete."""
        ...


class ReadNow:
    """Read at once: the host is the device (CPU), so there is nothing to wait for later."""

    __slots__ = ("values",)

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.values = tuple(map(torch.Tensor.item, tensors))

    def result(self) -> tuple[float, ...]:
        return self.values
