"""Prepared loaders over a :class:`ShardedStream`: an ``IterableDataset`` each process reads its own
part of, whose position is saved in checkpoints and restored without replaying the stream.

Accelerate's loaders over an iterable dataset either read the whole stream on the main process and
send each process its slice (dispatch), or have every process read the whole stream and keep its
slice; resuming replays the stream from its start (``skip_first_batches`` reads and drops what was
consumed). A ``ShardedStream`` does neither: the runtime tells it which part is this process's
(``set_shard``), each process batches its own items, and a checkpoint holds each process's position
in its part (``state_dict``: a byte offset, a packing buffer...), so a resumed run seeks there.

Every process stops after the same batch. The parts seldom end at the same batch (they hold
different documents), so the processes agree, batch by batch, whether every one of them has the next
batch: the pass ends at the first process's end, and what the others still had of their parts is
not trained on in that epoch. The agreement is the runtime's step flag (one asynchronous host
all-reduce per batch, read one batch later: the loader reads one batch further ahead), so it costs
no wait and no device sync; a pass's first batch is agreed with one blocking all-reduce. A process's
incomplete last batch is not used (every batch has ``batch_size`` items: fixed shapes).
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from app.distributed.backends.base import Backend
from app.distributed.operations import send_to_device
from app.distributed.state import GradientState
from app.distributed.step_flags import LaggedFlag, StepFlag


@runtime_checkable
class ShardedStream(Protocol):
    """An ``IterableDataset`` that reads only its process's part of the data, and whose iteration
    position can be saved and restored (the ``Stateful`` convention of ``datasets`` and torchdata):
    ``state_dict()`` is the position after the last item the current iteration yielded,
    ``load_state_dict`` sets where the next iteration starts."""

    def set_shard(self, index: int, count: int) -> None:
        """Read part ``index`` of ``count`` (every process its own; together the whole data, once);
        the next iteration starts at that part's beginning."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __iter__(self) -> Iterator[Any]: ...


class StreamLoaderShard:
    """Iterates this process's batches of a :class:`ShardedStream`, on the device; marks the pass's
    last batch (``end_of_dataloader``) and records, per batch handed out, the stream's position
    after it: what a checkpoint saves (``state_dict``; one per process: ``per_process_state``)."""

    per_process_state = True
    """The position differs between processes: each saves its own, and a checkpoint resumes only on
    as many processes as it was saved by (the checkpoint format's rule for such loaders)."""

    def __init__(self, loader: DataLoader, *, backend: Backend, device: torch.device, state: GradientState,
                 place: Callable[[Any], Any] | None = None):
        if loader.batch_size is None:
            raise ValueError("prepare() needs a batch_size for a DataLoader over a ShardedStream.")
        if loader.num_workers:
            raise ValueError("a ShardedStream is read in the training process itself (its position is that "
                             "process's); build its DataLoader with num_workers=0.")
        self.base_dataloader = loader
        self.dataset = cast(ShardedStream, loader.dataset)  # prepare() sends only these here
        self.backend = backend
        self.device = device
        self.gradient_state = state
        self.batch_size = loader.batch_size
        self.collate_fn = loader.collate_fn or default_collate
        self._place = place if place is not None else (
            None if device.type == "cpu" else lambda batch: send_to_device(batch, device))
        self.dataset.set_shard(backend.process_index, backend.num_processes)
        self._start = copy.deepcopy(self.dataset.state_dict())
        """The beginning of this process's part: where every pass starts."""
        self._consumed = self._start
        """The position after the last batch handed out (what a checkpoint saves)."""
        self.epoch = 0
        """The pass the next iteration continues or starts (a finished pass moves it on)."""
        self.position = 0
        """Batches of the current pass handed out (resumed ones included)."""
        self.pass_finished = False
        """Whether the batch handed out last was its pass's last one (the loop counts the epoch done)."""
        self.end_of_dataloader = False
        self.remainder = -1

    @property
    def total_batch_size(self) -> int:
        return self.batch_size * self.backend.num_processes

    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch`` at the beginning of the stream (the current pass continues if it is that one)."""
        if epoch != self.epoch:
            self.epoch, self.position, self._consumed = epoch, 0, self._start

    def skip_first_batches(self, num_batches: int) -> StreamLoaderShard:
        """A stream is never replayed: resuming continues from the position its checkpoint restored, so
        ``num_batches`` must be the batches of this pass already consumed."""
        if num_batches != self.position:
            raise ValueError(f"a streamed loader resumes where its checkpoint left it ({self.position} batches into "
                             f"pass {self.epoch}); it cannot skip to batch {num_batches} without replaying the stream.")
        return self

    def _local_batches(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """This process's full batches, each with the stream's position right after it."""
        items = iter(self.dataset)
        while True:
            chunk = list(itertools.islice(items, self.batch_size))
            if len(chunk) < self.batch_size:
                return  # the part's end: an incomplete last batch is not used
            yield self.collate_fn(chunk), copy.deepcopy(self.dataset.state_dict())

    def _agreed(self, have: list[bool]) -> list[bool]:
        """For each of a few upcoming batches, whether every process has it (one blocking all-reduce)."""
        if self.backend.num_processes == 1:
            return have
        flags = torch.tensor([float(h) for h in have], device=self.device)
        return [value > 0 for value in self.backend.all_reduce(flags, "min").tolist()]

    def __iter__(self) -> Iterator[Any]:
        self.dataset.load_state_dict(copy.deepcopy(self._consumed))
        self.end_of_dataloader, self.remainder, self.pass_finished = False, -1, False
        flag: StepFlag | None = self.backend.step_flag() if self.backend.num_processes > 1 else None
        # A lagged flag's answer comes one batch later: ask it about the batch after next.
        lag = 1 if isinstance(flag, LaggedFlag) else 0
        batches = self._local_batches()
        queue: deque[tuple[Any, dict[str, Any]]] = deque(itertools.islice(batches, lag + 2))
        # known[i]: whether every process has the current batch + i; the first ones agreed by blocking.
        known = deque(self._agreed([len(queue) > i for i in range(lag + 1)]))
        if not known[0] and self.position == 0:
            raise ValueError(f"a pass over the stream gave not every one of the {self.backend.num_processes} "
                             f"process(es) a full batch of {self.batch_size} items: use a smaller batch or more data.")
        self.pass_finished = not known[0]  # a resumed pass with nothing left is over
        self.gradient_state.active.append(self)
        try:
            step = 0
            while known[0]:
                batch, after = queue.popleft()
                if flag is None:
                    known.append(bool(queue))
                else:
                    # Every process posts once per batch; the answer is about the batch after this one.
                    lacking = flag.post(len(queue) <= lag)
                    if step >= lag:
                        known.append(not lacking)
                last = not known[1]
                self.end_of_dataloader, self.pass_finished = last, last
                self.remainder = self.total_batch_size if last else -1
                self.position += 1
                self._consumed = after
                yield self._place(batch) if self._place is not None else batch
                if last:
                    break
                known.popleft()
                queue.extend(itertools.islice(batches, 1))
                step += 1
            self.epoch, self.position, self._consumed = self.epoch + 1, 0, self._start
        finally:
            if flag is not None:
                flag.close()
            self.gradient_state.active.remove(self)
            self.end_of_dataloader = False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_in_epoch": self.position, "stream": self._consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["batches_in_epoch"])
        self._consumed = state["stream"] if self.position else self._start
        self.dataset.load_state_dict(copy.deepcopy(self._consumed))  # a stream may refuse another file here
