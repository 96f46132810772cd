"""Prepared loaders over an ``IterableDataset`` (no ``len()``, no sampler).

The stream is cut into *global batches* of ``batch_size x num_processes`` items (``batch_size`` with
``split_batches``); process ``r`` takes the ``r``-th slice of each and collates it. Two ways, as in
Accelerate:
- dispatched (the default for iterable datasets): only the main process reads the stream and sends
  each global batch to the others (they may have different streams, e.g. a per-rank random order);
- split (``DataLoaderConfiguration(dispatch_batches=False)``): every process reads the whole stream
  and keeps its slice (the stream must be the same on every process).
The last global batch, when short, is completed with the first items of the pass (``even_batches``),
and ``remainder`` records how many items are real so ``gather_for_metrics`` drops the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from app.distributed.backends.base import Backend
from app.distributed.data.map_style import with_last_flag
from app.distributed.operations import send_to_device
from app.distributed.state import GradientState


def _item(x: Any) -> Any:
    return x


class IterableDataLoaderShard:
    """Iterates this process's batches of an iterable dataset, marking the last one (one ahead)."""

    def __init__(self, loader: DataLoader, *, backend: Backend, device: torch.device, state: GradientState,
                 split_batches: bool, even_batches: bool, dispatch: bool):
        """``loader`` may also be over a map-style dataset (``dispatch_batches=True``): the main
        process then reads it in its sampler's order and dispatches it the same way."""
        n = backend.num_processes
        if loader.batch_size is None:
            raise ValueError("prepare() needs a batch_size for a DataLoader over an IterableDataset.")
        if split_batches and loader.batch_size % n:
            raise ValueError(f"split_batches needs a batch size ({loader.batch_size}) divisible by the number of "
                             f"processes ({n}).")
        self.base_dataloader = loader
        self.dataset = loader.dataset
        self.backend = backend
        self.device = device
        self.gradient_state = state
        self.batch_size = loader.batch_size // n if split_batches else loader.batch_size
        self.even_batches = even_batches
        self.dispatch = dispatch
        self.drop_last = loader.drop_last
        self.end_of_dataloader = False
        self.remainder = -1
        self.position = 0
        """Global batches of the current pass already handed out."""
        self.epoch = 0
        self._skip = 0
        # Raw items, one at a time (workers still apply); collate_fn runs on this process's slice.
        mapped = not isinstance(loader.dataset, IterableDataset)
        order = loader.batch_sampler.sampler if mapped and isinstance(loader.batch_sampler, BatchSampler) else None
        self._length = len(loader.dataset) if mapped else None  # type: ignore[arg-type]
        self._items = DataLoader(loader.dataset, batch_size=None, sampler=order, collate_fn=_item,
                                 num_workers=loader.num_workers, worker_init_fn=loader.worker_init_fn)
        self._collate = loader.collate_fn

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.backend.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _global_batches(self) -> Iterator[tuple[list[Any], int]]:
        """(items, how many are real) per global batch; the last one completed when batches are even."""
        size, chunk, first = self.global_batch, [], None
        for item in self._items:
            chunk.append(item)
            if len(chunk) == size:
                first = first if first is not None else list(chunk)
                yield chunk, size
                chunk = []
        if chunk and not self.drop_last:
            real = len(chunk)
            if self.even_batches and self.backend.num_processes > 1:
                pool = first if first is not None else list(chunk)
                while len(chunk) < size:
                    chunk += pool[: size - len(chunk)]
            yield chunk, real

    def _received(self) -> Iterator[tuple[list[Any], int]]:
        if not self.dispatch or self.backend.num_processes == 1:
            yield from self._global_batches()
            return
        source = self._global_batches() if self.backend.process_index == 0 else None
        while True:
            message = next(source, None) if source is not None else None
            message = self.backend.broadcast_object(message, src=0)
            if message is None:
                return
            yield message

    def _batches(self) -> Iterator[tuple[Any, int]]:
        r, b = self.backend.process_index, self.batch_size
        for step, (chunk, real) in enumerate(self._received()):
            if step < self._skip:
                continue
            part = chunk[r * b:(r + 1) * b]
            if part:
                yield self._collate(part), real

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.remainder = -1
        self.position = self._skip
        batches = self._batches()
        self.gradient_state.active.append(self)
        try:
            for (batch, real), last in with_last_flag(batches):
                if last:
                    self.end_of_dataloader = True
                    self.remainder = real
                self.position += 1
                yield send_to_device(batch, self.device)
            self.position = 0
            self.set_epoch(self.epoch + 1)
        finally:
            self.gradient_state.active.remove(self)
            self.end_of_dataloader = False
            self._skip = 0

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("a prepared DataLoader over an IterableDataset has no len().")
        if self.drop_last:
            return self._length // self.global_batch
        return math.ceil(self._length / self.global_batch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "steps_in_epoch": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next pass skips the global batches already consumed (it reads and drops them)."""
        self.epoch = int(state["epoch"])
        self._skip = self.position = int(state["steps_in_epoch"])
