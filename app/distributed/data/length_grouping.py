"""Batches of similar length: less padding, the same samples per epoch.

With dynamic padding a batch costs as much as its longest sample times the batch size. Drawn at
random, MRPC batches of 16 carry about 1.44 tokens per real token; grouped, about 1.02 (measured
with the MiniLM tokenizer), so a CPU step gets roughly a third cheaper.

The grouping follows the Hugging Face Trainer's ``group_by_length``: shuffle, cut the permutation
into mega-batches of ``50 * batch_size`` samples, sort each by length (longest first), cut into
batches. Unlike it, the batches are then shuffled, so an epoch does not run long-to-short
sawtooths, and the only short batch stays last, which keeps batch boundaries where the sampler
puts them. Everything is drawn from the generator it is given: the same (seed, epoch) gives the
same order, so a resumed run sees exactly the samples the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

MEGA_BATCH_MULT = 50
"""Samples sorted together, in batches: large enough to find similar lengths, small enough to keep
the epoch random (the Trainer's value)."""


def group_by_length(order: Sequence[int], lengths: Sequence[int], batch_size: int,
                    generator: torch.Generator) -> list[int]:
    """``order`` rearranged so that each consecutive ``batch_size`` indices have similar lengths."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    mega = batch_size * MEGA_BATCH_MULT
    grouped: list[int] = []
    for start in range(0, len(order), mega):
        grouped.extend(sorted(order[start : start + mega], key=lambda i: -lengths[i]))
    batches = [grouped[i : i + batch_size] for i in range(0, len(grouped), batch_size)]
    # Mega-batches hold whole batches, so only the very last batch can be short; it stays last.
    full = len(batches) - int(bool(batches) and len(batches[-1]) < batch_size)
    shuffled = [batches[i] for i in torch.randperm(full, generator=generator).tolist()] + batches[full:]
    return [i for batch in shuffled for i in batch]


class LengthGroupedSampler(Sampler[int]):
    """A shuffling sampler whose consecutive ``batch_size`` samples have similar lengths.

    ``DataLoader(dataset, batch_size=b, sampler=LengthGroupedSampler(lengths, b))`` works on its own;
    ``Accelerator.prepare`` recognises it and applies the same grouping to each process's batches
    (batches are grouped per process, so the order does not depend on the number of processes).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int = 0):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        return iter(group_by_length(order, self.lengths, self.batch_size, generator))
