"""Data loading for one or many processes: a deterministic, shardable, resumable batch sampler and
the DataLoader wrapper that moves batches to the device and tells the runtime where the epoch ends.

Sample order. Each epoch draws one permutation from ``seed + epoch`` (identical on every rank), cuts
it into *global steps* of ``num_processes`` per-process batches, and hands batch ``r`` of every
global step to rank ``r``. Gathering the batches of one step across ranks therefore yields the
samples in their global order, which is what ``gather_for_metrics`` relies on.

Uneven ends. With ``even_batches`` (the default) and several processes the last global step is
completed with samples from the start of the epoch, so every rank runs the same number of equally
sized batches; ``remainder`` records how many of that step's samples are real so the duplicates can
be dropped after a gather. Without it, ranks may get fewer or smaller batches at the end. With
``fixed_shapes`` (a backend that compiles one program per shape, XLA) the last step is completed
the same way even on one process, so every batch of every loader has the full size.

Resuming. The sampler's position is (epoch, global steps already taken); skipping is an index slice,
so resuming never replays the data pipeline. A loader's ``state_dict`` records the position as
*samples* consumed in the epoch, so a different number of processes resumes at the same sample.
Iterating never draws from the global torch RNG (the DataLoader gets its own generator, seeded per
epoch): a run resumed mid-epoch consumes random numbers exactly as the uninterrupted run did.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from app.distributed.length_grouping import LengthGroupedSampler, group_by_length
from app.distributed.operations import recursively_apply

log = logging.getLogger(__name__)


class GradientState:
    """What the data pipeline tells the gradient-accumulation logic (owned by one Accelerator).

    Loaders being iterated form a stack (an evaluation loop may run inside a training epoch); the
    innermost one answers ``end_of_dataloader`` and ``remainder``.
    """

    def __init__(self) -> None:
        self.sync_gradients = True
        self.active: list[DataLoaderShard] = []

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active)

    @property
    def end_of_dataloader(self) -> bool:
        return self.active[-1].end_of_dataloader if self.active else False

    @property
    def remainder(self) -> int:
        """Real samples in the last global step of the innermost loader; -1 before its end."""
        return self.active[-1].remainder if self.active else -1


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of dataset indices. See the module docstring for the order."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        even_batches: bool = True,
        split_batches: bool = False,
        lengths: Sequence[int] | None = None,
        fixed_shapes: bool = False,
    ):
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"got {len(lengths)} lengths for {num_samples} samples")
        if split_batches and batch_size % num_processes:
            raise ValueError(
                f"split_batches needs a batch size ({batch_size}) divisible by the number of processes "
                f"({num_processes})."
            )
        self.num_samples = num_samples
        self.per_process_batch = batch_size // num_processes if split_batches else batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.lengths = lengths
        """Sample lengths: when given, each process's batches hold samples of similar length."""
        self.fixed_shapes = fixed_shapes
        """Every batch full-sized, even on one process: the last global step is completed like with
        ``even_batches`` (for compilers such as XLA that build one program per shape)."""
        self.epoch = 0
        self.skip_steps = 0
        """Global steps of the current epoch to skip (set when resuming mid-epoch)."""

    @property
    def global_batch(self) -> int:
        return self.per_process_batch * self.num_processes

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            # A skip (resume) applies to the epoch it was set for only.
            self.skip_steps = 0
        self.epoch = epoch

    def global_steps(self) -> int:
        """Global steps in a full epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def __len__(self) -> int:
        steps = self.global_steps() - self.skip_steps
        if self.drop_last or self.even_batches or self.fixed_shapes or self.num_processes == 1:
            return max(steps, 0)
        # Without even batches, trailing ranks may have nothing in the last global step.
        last_step_samples = self.num_samples - (self.global_steps() - 1) * self.global_batch
        has_last = self.process_index * self.per_process_batch < last_step_samples
        return max(steps - 1 + int(has_last), 0)

    def epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        if self.lengths is not None:
            # Grouped per process batch, not per global step: the order stays the same when a run
            # resumes on another number of processes.
            order = group_by_length(order, self.lengths, self.per_process_batch, generator)
        return order

    def last_step_remainder(self) -> int:
        """Real samples in the final global step of an epoch."""
        if self.drop_last:
            return self.global_batch
        return self.num_samples - (self.global_steps() - 1) * self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order()
        steps = self.global_steps()
        pad = steps * self.global_batch - len(order)
        if pad > 0 and (self.fixed_shapes or (self.even_batches and self.num_processes > 1)):
            # Complete the last global step with samples from the start of the epoch (cycling, for
            # datasets smaller than one global step).
            order = order + [order[i % len(order)] for i in range(pad)]
        b, r = self.per_process_batch, self.process_index
        for step in range(self.skip_steps, steps):
            start = step * self.global_batch + r * b
            batch = order[start : start + b]
            if batch:
                yield batch


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``; other leaves stay as they are."""
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), obj, error_on_other=False)


_END = object()


class DataLoaderShard:
    """Iterates this rank's batches, on the device, marking the last batch of the epoch.

    Looks one batch ahead so that ``end_of_dataloader`` is already true while the last batch is being
    processed: gradient accumulation forces a synchronising step there, and ``gather_for_metrics``
    drops the padding duplicates.
    """

    def __init__(self, loader: DataLoader, batch_sampler: ShardedBatchSampler, device: torch.device,
                 state: GradientState, generator: torch.Generator | None = None,
                 place: Callable[[Any], Any] | None = None):
        self.base_dataloader = loader
        self.generator = generator
        self.position = 0
        """Global steps of the current epoch already handed out (skipped ones included)."""
        self._resume_at: int | None = None
        """Set by load_state_dict: where the next iteration of this epoch starts."""
        self.batch_sampler = batch_sampler
        self.device = device
        self.gradient_state = state
        # Batches built on CPU need no copy when the device is the CPU; ``place`` is the backend's
        # way to put a batch on its device (XLA shards it over the mesh on the way).
        self._place = place if place is not None else (
            None if device.type == "cpu" else lambda batch: send_to_device(batch, device))
        self.dataset = loader.dataset
        self.batch_size = batch_sampler.per_process_batch
        self.end_of_dataloader = False
        self.remainder = -1

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.batch_sampler.epoch:
            self.position = 0
            self._resume_at = None
        self.batch_sampler.set_epoch(epoch)

    @property
    def total_dataset_length(self) -> int:
        return self.batch_sampler.num_samples

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.remainder = -1
        sampler = self.batch_sampler
        if self.generator is not None:
            # Worker seeds depend on (seed, epoch) only, and the global RNG is left untouched.
            self.generator.manual_seed(sampler.seed + sampler.epoch)
        if self._resume_at is not None and not sampler.skip_steps:
            sampler.skip_steps = self._resume_at
        self._resume_at = None
        self.position = sampler.skip_steps
        iterator = iter(self.base_dataloader)
        self.gradient_state.active.append(self)
        try:
            current = next(iterator, _END)
            while current is not _END:
                upcoming = next(iterator, _END)
                if upcoming is _END:
                    self.end_of_dataloader = True
                    self.remainder = self.batch_sampler.last_step_remainder()
                self.position += 1
                yield self._place(current) if self._place is not None else current
                current = upcoming
            # A finished pass leaves nothing to skip: a checkpoint taken now resumes at a fresh pass
            # (the evaluation loader, or the training loader once the loop moves to the next epoch).
            self.position = 0
        finally:
            self.gradient_state.active.remove(self)
            self.end_of_dataloader = False
            # A resumed epoch skips only once; the next epoch starts from its beginning.
            self.batch_sampler.skip_steps = 0

    def state_dict(self) -> dict[str, int]:
        """Epoch, shuffle seed and samples consumed in the epoch (by all processes together)."""
        s = self.batch_sampler
        # Inside the epoch's last step (not yet moved on): the whole epoch is consumed.
        done = s.num_samples if self.position >= s.global_steps() else self.position * s.global_batch
        return {"epoch": s.epoch, "seed": s.seed, "global_batch": s.global_batch, "samples_in_epoch": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` left off: the next iteration of that epoch skips the consumed
        samples (an index slice; ``len()`` still counts the whole epoch). With another global batch
        size the position is rounded down to a whole global step, so a few samples may be seen
        twice, never skipped."""
        s = self.batch_sampler
        s.seed = int(state["seed"])
        s.epoch = int(state["epoch"])
        done = int(state["samples_in_epoch"])
        self._resume_at = self.position = s.global_steps() if done >= s.num_samples else done // s.global_batch
        if done < s.num_samples and done % s.global_batch:
            log.warning("resuming %d samples into epoch %d with a global batch of %d: the last %d samples "
                        "before the checkpoint are seen again.", done, s.epoch, s.global_batch,
                        done % s.global_batch)


def find_sampling(loader: DataLoader) -> tuple[bool, Sequence[int] | None]:
    """Whether the user's loader shuffles, and the sample lengths when it groups them by length."""
    sampler = loader.batch_sampler.sampler if isinstance(loader.batch_sampler, BatchSampler) else loader.sampler
    if isinstance(sampler, LengthGroupedSampler):
        return True, sampler.lengths
    return isinstance(sampler, RandomSampler), None


def shard_dataloader(
    loader: DataLoader,
    *,
    device: torch.device,
    state: GradientState,
    num_processes: int,
    process_index: int,
    seed: int,
    even_batches: bool,
    split_batches: bool,
    fixed_shapes: bool = False,
    place: Callable[[Any], Any] | None = None,
) -> DataLoaderShard:
    """Rebuild a user's DataLoader around a :class:`ShardedBatchSampler` (same dataset, collate_fn,
    workers); a RandomSampler becomes the seeded per-epoch shuffle, a LengthGroupedSampler the same
    shuffle grouped by length."""
    if loader.batch_size is None:
        raise ValueError("prepare() needs a DataLoader built with batch_size (a custom batch_sampler is not supported).")
    shuffle, lengths = find_sampling(loader)
    sampler = ShardedBatchSampler(
        len(loader.dataset),  # type: ignore[arg-type]
        loader.batch_size,
        shuffle=shuffle,
        lengths=lengths,
        seed=seed,
        drop_last=loader.drop_last,
        num_processes=num_processes,
        process_index=process_index,
        even_batches=even_batches,
        split_batches=split_batches,
        fixed_shapes=fixed_shapes,
    )
    generator = torch.Generator()
    rebuilt = DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        generator=generator,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )
    return DataLoaderShard(rebuilt, sampler, device, state, generator, place)


def skip_first_batches(loader: DataLoaderShard, num_batches: int) -> DataLoaderShard:
    """The same loader, starting ``num_batches`` (per-process) batches into the current epoch.

    Skipping happens on indices, so no skipped sample is loaded or collated.
    """
    loader.batch_sampler.skip_steps = num_batches
    return loader
