"""Prepared loaders over a map-style dataset (one with ``len()`` and indices), for one or many
processes: a deterministic, shardable, resumable batch sampler and the DataLoader wrapper that moves
batches to the device and tells the runtime where the epoch ends.

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

Where the order comes from. With a data seed (``Accelerator(seed=...)``, as the engine passes, or
``DataLoaderConfiguration(use_seedable_sampler=True)``) each epoch's permutation is drawn from
``seed + epoch``. Without one (Accelerate's default) the order is whatever the user's sampler yields
at each pass, so one process sees exactly the order of the plain DataLoader; on several processes a
shuffling sampler without a generator gets one, seeded as Accelerate seeds it (one int64 drawn from
the global torch RNG when the loader is prepared), and its state is made common to all ranks (rank
0's, at every pass). Either way a finished pass moves to the next epoch, so a shuffled loader
reshuffles without ``set_epoch`` (which still selects an epoch explicitly).

Random numbers a pass consumes. As a plain DataLoader (and Accelerate), each pass draws its workers'
base seed: one number from the user's ``generator=``, else from the global torch RNG, shuffled or
not. Only ``own_rng`` (the Accelerator's ``seed=``, which the engine passes) gives the loader its own
generator, reseeded from ``(seed, epoch)`` at every pass, so iterating never draws from the global
RNG and a run resumed mid-epoch consumes random numbers exactly as the uninterrupted run did.

A user's own batch sampler (``DataLoader(batch_sampler=...)``, or ``sampler=BatchSampler(...),
batch_size=None``) is kept: its batches are dealt to the ranks in turn (Accelerate's
``BatchSamplerShard``). Iterable datasets are handled in ``iterable.py`` and ``stream.py``.

Resuming. The sampler's position is (epoch, global steps already taken); skipping is an index slice,
so resuming never replays the data pipeline. A loader's ``state_dict`` records the position as
*samples* consumed in the epoch, so a different number of processes resumes at the same sample.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

from app.distributed.data.length_grouping import LengthGroupedSampler, group_by_length
from app.distributed.data.prefetch import prefetched
from app.distributed.operations import send_to_device
from app.distributed.state import GradientState

log = logging.getLogger(__name__)


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose pass ``e`` is the permutation drawn from ``initial_seed + e``
    (Accelerate's class and semantics): reproducible whatever else draws random numbers, and
    identical on every process given the same seed. ``initial_seed`` defaults to
    ``data_seed``, else ``torch.initial_seed()``."""

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.initial_seed()
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_permutation(self) -> list[int]:
        """The whole order of one pass, as iterating yields it, in one call (no Python step per
        index); the epoch then moves on, as after a finished pass."""
        n = len(self.data_source)
        if self.replacement or self.num_samples != n:
            return list(self)
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        order = torch.randperm(n, generator=self.generator).tolist()
        self.set_epoch(self.epoch + 1)
        return order


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
        sampler: Sampler[int] | None = None,
        batch_sampler: Any = None,
        fixed_shapes: bool = False,
    ):
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"got {len(lengths)} lengths for {num_samples} samples")
        if split_batches and batch_size % num_processes:
            raise ValueError(
                f"split_batches needs a batch size ({batch_size}) divisible by the number of processes "
                f"({num_processes})."
            )
        self.sampler = sampler
        """Where each pass's order comes from (None: ``seed + epoch``, or sequential)."""
        self.batch_source = batch_sampler
        """A user's batch sampler whose batches are dealt to the ranks (Accelerate's BatchSamplerShard)."""
        self.split_batches = split_batches
        self.num_samples = num_samples
        self.per_process_batch = batch_size // num_processes if split_batches else batch_size
        self.shuffle = shuffle
        self._seed = seed
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
    def seed(self) -> int:
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = value
        if isinstance(self.sampler, SeedableRandomSampler):
            self.sampler.initial_seed = value

    @property
    def batch_sampler(self) -> Any:
        """What the shards are cut from (Accelerate's ``BatchSamplerShard.batch_sampler``): the user's
        batch sampler, or a BatchSampler over the order's sampler."""
        if self.batch_source is not None:
            return self.batch_source
        order = self.sampler if self.sampler is not None else SequentialSampler(range(self.num_samples))
        return BatchSampler(order, self.per_process_batch, self.drop_last)

    @property
    def global_batch(self) -> int:
        return self.per_process_batch * self.num_processes

    @property
    def drawn_per_pass(self) -> bool:
        """Whether the order is drawn from the user's sampler when a pass starts."""
        return self.batch_source is not None or (self.sampler is not None and not isinstance(self.sampler, SeedableRandomSampler))

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            # A skip (resume) applies to the epoch it was set for only.
            self.skip_steps = 0
        self.epoch = epoch

    def global_steps(self) -> int:
        """Global steps in a full epoch."""
        if self.batch_source is not None:
            batches = len(self.batch_source)
            if self.split_batches:
                return batches
            whole, extra = divmod(batches, self.num_processes)
            return whole + int(extra > 0 and not self.drop_last)
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def __len__(self) -> int:
        steps = self.global_steps() - self.skip_steps
        if self.batch_source is not None and not (self.split_batches or self.even_batches or self.drop_last):
            extra = len(self.batch_source) % self.num_processes
            return max(steps - int(0 < extra <= self.process_index), 0)
        if self.drop_last or self.even_batches or self.fixed_shapes or self.num_processes == 1:
            return max(steps, 0)
        # Without even batches, trailing ranks may have nothing in the last global step.
        last_step_samples = self.num_samples - (self.global_steps() - 1) * self.global_batch
        has_last = self.process_index * self.per_process_batch < last_step_samples
        return max(steps - 1 + int(has_last), 0)

    def epoch_order(self) -> list[int]:
        if self.sampler is not None:
            if isinstance(self.sampler, SeedableRandomSampler):
                self.sampler.set_epoch(self.epoch)
                return self.sampler.epoch_permutation()
            return list(self.sampler)
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
        if self.batch_source is not None:
            return self._last_real
        if self.drop_last:
            return self.global_batch
        return self.num_samples - (self.global_steps() - 1) * self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        if self.batch_source is not None:
            yield from self._deal(list(self.batch_source))
            return
        order = self.epoch_order()
        steps = self.global_steps()
        pad = steps * self.global_batch - len(order)
        if pad > 0 and (self.fixed_shapes or (self.even_batches and self.num_processes > 1)):
            # Complete the last global step with samples from the start of the epoch (cycling, for
            # datasets smaller than one global step).
            order = order + [order[i % len(order)] for i in range(pad)]
        b, r, global_batch = self.per_process_batch, self.process_index, self.global_batch
        for step in range(self.skip_steps, steps):
            start = step * global_batch + r * b
            batch = order[start : start + b]
            if batch:
                yield batch

    _last_real = -1

    def _deal(self, batches: list[list[int]]) -> Iterator[list[int]]:
        """A user's batches, dealt to the ranks: global step ``s`` is batches ``s*n .. s*n+n-1``
        (with ``split_batches``: batch ``s``, cut in ``n`` parts). The last global step is completed
        from the epoch's first samples when batches are even, as Accelerate's BatchSamplerShard does."""
        n, r = self.num_processes, self.process_index
        size = getattr(self.batch_source, "batch_size", None)
        if self.split_batches:
            if not size or size % n:
                raise ValueError(f"split_batches needs the batch sampler's batch_size ({size}) to be a multiple of "
                                 f"the number of processes ({n}).")
            per = size // n
            steps = [[batch[i * per:(i + 1) * per] for i in range(n)] for batch in batches]
        else:
            per = size or max((len(b) for b in batches), default=0)
            steps = [batches[i:i + n] for i in range(0, len(batches), n)]
        first = [i for step in steps[:1] for part in step for i in part] or [i for b in batches for i in b]
        if steps:
            last = steps[-1]
            real = sum(len(part) for part in last)
            self._last_real = real
            incomplete = len(last) < n or any(len(part) < per for part in last)
            if incomplete and self.drop_last:
                steps = steps[:-1]
                self._last_real = per * n
            elif incomplete and self.even_batches and n > 1:
                pool = [i for part in last for i in part]
                cycle = first * (per * n // max(len(first), 1) + 1)
                pool += cycle[: per * n - len(pool)]
                steps[-1] = [pool[i * per:(i + 1) * per] for i in range(n)]
        for step in steps[self.skip_steps:]:
            if r < len(step) and step[r]:
                yield step[r]


def draw_generator_seed() -> int:
    """One seed drawn from the global torch RNG exactly as Accelerate draws the seed of a shuffling
    sampler's generator on several processes (a full-range int64), so the same ``set_seed`` gives
    the same order."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


_END = object()


def with_last_flag(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last: the next item is fetched before this one is handed
    out, so a loader knows at its final batch (when gradients must synchronise) that the pass ends."""
    current = next(items, _END)
    while current is not _END:
        upcoming = next(items, _END)
        yield current, upcoming is _END
        current = upcoming


class DataLoaderShard:
    """Iterates this rank's batches, on the device, marking the last batch of the epoch.

    Looks one batch ahead so that ``end_of_dataloader`` is already true while the last batch is being
    processed: gradient accumulation forces a synchronising step there, and ``gather_for_metrics``
    drops the padding duplicates.
    """

    def __init__(self, loader: DataLoader, batch_sampler: ShardedBatchSampler, device: torch.device,
                 state: GradientState, generator: torch.Generator | None = None,
                 before_pass: Callable[[], None] | None = None, place: Callable[[Any], Any] | None = None,
                 prefetch: int = 0):
        self.base_dataloader = loader
        self.generator = generator
        """Our own generator (seeded mode): reseeded from (seed, epoch) at every pass."""
        self.before_pass = before_pass
        """Called when a pass starts (makes the user's sampler generator common to all ranks)."""
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
        self.prefetch = prefetch if self._place is not None else 0
        """Batches a background thread loads and places ahead of the loop (``app/distributed/data/prefetch.py``;
        the backend's ``prefetch_depth``); 0: each batch is loaded and placed when the loop asks for it."""
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

    @property
    def epoch(self) -> int:
        """The epoch the next pass iterates (``set_epoch`` chooses it; a finished pass moves it on)."""
        return self.batch_sampler.epoch

    @property
    def collate_fn(self) -> Any:
        """The user's ``collate_fn`` (a loader of other data can batch the same way)."""
        return self.base_dataloader.collate_fn

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.remainder = -1
        sampler = self.batch_sampler
        if self.generator is not None:
            # Worker seeds depend on (seed, epoch) only, and the global RNG is left untouched.
            self.generator.manual_seed(sampler.seed + sampler.epoch)
        if self.before_pass is not None:
            self.before_pass()
        if self._resume_at is not None and not sampler.skip_steps:
            sampler.skip_steps = self._resume_at
        self._resume_at = None
        self.position = sampler.skip_steps
        batches: Iterator[Any] = iter(self.base_dataloader)
        place, ahead = self._place, None
        if self.prefetch and place is not None:
            # Loaded and placed ahead by a thread; the lookahead below then sees placed batches.
            batches = ahead = prefetched(batches, place, self.prefetch)
            place = None
        self.gradient_state.active.append(self)
        try:
            for batch, last in with_last_flag(batches):
                if last:
                    self.end_of_dataloader = True
                    self.remainder = self.batch_sampler.last_step_remainder()
                self.position += 1
                yield place(batch) if place is not None else batch
            # A finished pass leaves nothing to skip, and the next pass is the next epoch (a shuffled
            # loader reshuffles without set_epoch; set_epoch still picks an epoch explicitly).
            self.position = 0
            sampler.set_epoch(sampler.epoch + 1)
        finally:
            if ahead is not None:  # the prefetching thread stops before the sampler's state is reset below
                ahead.close()
            self.gradient_state.active.remove(self)
            self.end_of_dataloader = False
            # A resumed epoch skips only once; the next epoch starts from its beginning.
            self.batch_sampler.skip_steps = 0

    def state_dict(self) -> dict[str, int]:
        """Epoch, shuffle seed and samples consumed in the epoch (by all processes together); for a
        user's batch sampler, global steps consumed."""
        s = self.batch_sampler
        if s.batch_source is not None:
            return {"epoch": s.epoch, "seed": s.seed, "steps_in_epoch": self.position}
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
        if "steps_in_epoch" in state:
            self._resume_at = self.position = int(state["steps_in_epoch"])
            return
        done = int(state["samples_in_epoch"])
        self._resume_at = self.position = s.global_steps() if done >= s.num_samples else done // s.global_batch
        if done < s.num_samples and done % s.global_batch:
            log.warning("resuming %d samples into epoch %d with a global batch of %d: the last %d samples "
                        "before the checkpoint are seen again.", done, s.epoch, s.global_batch,
                        done % s.global_batch)


def user_sampler(loader: DataLoader) -> Any:
    """The index sampler inside the user's loader (None when it brings its own batch sampler)."""
    if isinstance(loader.sampler, BatchSampler):
        return None
    if isinstance(loader.batch_sampler, BatchSampler):
        return loader.batch_sampler.sampler
    return None if loader.batch_sampler is not None else loader.sampler


def user_batch_sampler(loader: DataLoader) -> Any:
    """The user's own batch sampler, or None for a plain ``batch_size`` loader."""
    if isinstance(loader.sampler, BatchSampler):
        return loader.sampler  # sampler=BatchSampler(...), batch_size=None
    if loader.batch_size is None and loader.batch_sampler is not None:
        return loader.batch_sampler
    return None


def shard_dataloader(
    loader: DataLoader,
    *,
    device: torch.device,
    state: GradientState,
    num_processes: int,
    process_index: int,
    seed: int | None,
    even_batches: bool,
    split_batches: bool,
    agreed_seed: Callable[[], int] | None = None,
    synchronize: Callable[[torch.Generator], None] | None = None,
    own_rng: bool = False,
    fixed_shapes: bool = False,
    place: Callable[[Any], Any] | None = None,
    prefetch: int = 0,
) -> DataLoaderShard:
    """Rebuild a user's DataLoader around a :class:`ShardedBatchSampler` (same dataset, collate_fn,
    workers). ``seed``: shuffle from ``seed + epoch`` (a RandomSampler becomes a
    SeedableRandomSampler, a LengthGroupedSampler the same shuffle grouped by length); None: follow
    the user's sampler at each pass. On several processes ``agreed_seed`` (called once per loader
    whose shuffling sampler has no generator) seeds a generator for it, and ``synchronize`` copies
    rank 0's generator state at every pass. ``own_rng`` (with a ``seed``): the loader's worker seeds
    come from its own generator, reseeded from ``(seed, epoch)`` at every pass, instead of the plain
    DataLoader's one draw per pass from the user's generator or the global RNG."""
    batch_source = user_batch_sampler(loader)
    sampler = user_sampler(loader)
    lengths = sampler.lengths if isinstance(sampler, LengthGroupedSampler) else None
    if isinstance(sampler, LengthGroupedSampler) and seed is None:
        seed = sampler.seed
    follow: Sampler[int] | None = None
    shuffle = isinstance(sampler, (RandomSampler, LengthGroupedSampler))
    if batch_source is None and lengths is None:
        if seed is not None and isinstance(sampler, RandomSampler) and not sampler.replacement:
            follow = SeedableRandomSampler(range(len(sampler)), num_samples=len(sampler), data_seed=seed)
        elif not isinstance(sampler, SequentialSampler):
            follow = sampler  # the user's order, drawn at each pass
    generator = loader.generator
    before_pass: Callable[[], None] | None = None
    owner = follow if not isinstance(follow, SeedableRandomSampler) else None
    owner = owner if owner is not None else getattr(batch_source, "sampler", None)
    if num_processes > 1 and isinstance(owner, RandomSampler):
        if owner.generator is None and agreed_seed is not None:
            owner.generator = torch.Generator().manual_seed(agreed_seed())
        if synchronize is not None and owner.generator is not None:
            before_pass = functools.partial(synchronize, owner.generator)
    own_generator = None
    if own_rng and seed is not None and ((follow is None and batch_source is None)
                                         or isinstance(follow, SeedableRandomSampler)):
        # The engine's seeded order: worker seeds from (seed, epoch), nothing drawn from the global RNG.
        generator = own_generator = torch.Generator()
    per_pass_len = len(follow) if follow is not None else len(loader.dataset)  # type: ignore[arg-type]
    batch_size = loader.batch_size if loader.batch_size is not None else getattr(batch_source, "batch_size", None) or 1
    sharded = ShardedBatchSampler(
        per_pass_len,
        batch_size,
        shuffle=shuffle,
        lengths=lengths,
        seed=seed if seed is not None else 0,
        drop_last=loader.drop_last if batch_source is None else bool(getattr(batch_source, "drop_last", False)),
        num_processes=num_processes,
        process_index=process_index,
        even_batches=even_batches,
        split_batches=split_batches,
        sampler=follow,
        batch_sampler=batch_source,
        fixed_shapes=fixed_shapes,
    )
    common: dict[str, Any] = {
        "collate_fn": loader.collate_fn, "num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn, "generator": generator,
        "persistent_workers": loader.persistent_workers if loader.num_workers > 0 else False}
    if isinstance(loader.sampler, BatchSampler):
        # sampler=BatchSampler(...), batch_size=None: the dataset is indexed with a whole batch.
        rebuilt = DataLoader(loader.dataset, sampler=sharded, batch_size=None, **common)  # type: ignore[arg-type]
    else:
        rebuilt = DataLoader(loader.dataset, batch_sampler=sharded, **common)  # type: ignore[arg-type]
    return DataLoaderShard(rebuilt, sharded, device, state, own_generator, before_pass, place, prefetch)


def skip_first_batches(loader: DataLoaderShard, num_batches: int) -> DataLoaderShard:
    """The same loader, starting ``num_batches`` (per-process) batches into the current epoch.

    Skipping happens on indices, so no skipped sample is loaded or collated.
    """
    loader.batch_sampler.skip_steps = num_batches
    return loader
