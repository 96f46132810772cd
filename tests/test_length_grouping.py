"""Length-grouped batches: every sample once per epoch, less padding, deterministic and resumable."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app.distributed import Accelerator, LengthGroupedSampler
from app.distributed.data.length_grouping import group_by_length
from app.distributed.data.map_style import shard_dataloader
from app.distributed.state import GradientState


def lengths_for(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, 120, (n,), generator=generator).tolist()


def padded_tokens(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(max(lengths[i] for i in b) * len(b) for b in batches)


@pytest.mark.parametrize("n,batch", [(1000, 16), (37, 4), (5, 8), (800, 16)])
def test_grouping_is_a_permutation_with_the_short_batch_last(n, batch):
    lengths = lengths_for(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    grouped = group_by_length(order, lengths, batch, torch.Generator().manual_seed(2))
    assert sorted(grouped) == list(range(n))
    batches = [grouped[i : i + batch] for i in range(0, n, batch)]
    assert all(len(b) == batch for b in batches[:-1])


def test_grouping_cuts_padding_and_batch_order_is_not_a_sawtooth():
    n, batch = 3200, 16
    lengths = lengths_for(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    grouped = group_by_length(order, lengths, batch, torch.Generator().manual_seed(2))
    random_cost = padded_tokens([order[i : i + batch] for i in range(0, n, batch)], lengths)
    grouped_batches = [grouped[i : i + batch] for i in range(0, n, batch)]
    grouped_cost = padded_tokens(grouped_batches, lengths)
    assert grouped_cost < 0.8 * random_cost
    assert grouped_cost < 1.05 * sum(lengths)
    # Batches are shuffled after sorting: the longest batches are not all at mega-batch starts.
    longest = [max(lengths[i] for i in b) for b in grouped_batches]
    descents = sum(a > b for a, b in itertools.pairwise(longest))
    assert 0.3 < descents / len(longest) < 0.7


def test_sampler_alone_is_seeded_per_epoch():
    lengths = lengths_for(200)
    sampler = LengthGroupedSampler(lengths, 8, seed=3)
    first = list(sampler)
    assert list(LengthGroupedSampler(lengths, 8, seed=3)) == first
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(200))
    loader = DataLoader(TensorDataset(torch.tensor(lengths)), batch_size=8, sampler=LengthGroupedSampler(lengths, 8))
    assert sum(len(b[0]) for b in loader) == 200


def shard(lengths, processes, rank, batch, seed=5):
    data = TensorDataset(torch.arange(len(lengths)))
    loader = DataLoader(data, batch_size=batch, sampler=LengthGroupedSampler(lengths, batch))
    return shard_dataloader(loader, device=torch.device("cpu"), state=GradientState(), num_processes=processes,
                            process_index=rank, seed=seed, even_batches=True, split_batches=False)


def test_prepare_keeps_the_grouping_and_the_order_does_not_depend_on_the_world_size():
    lengths = lengths_for(400)
    one = [b[0].tolist() for b in shard(lengths, 1, 0, 8)]
    two = [[b[0].tolist() for b in shard(lengths, 2, r, 8)] for r in range(2)]
    interleaved = [batch for step in zip(*two) for batch in step]
    assert interleaved == one  # rank r takes batch r of each global step, in the same order
    grouped_cost = padded_tokens(one, lengths)
    plain = DataLoader(TensorDataset(torch.arange(400)), batch_size=8, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    assert grouped_cost < 0.8 * padded_tokens([b[0].tolist() for b in plain], lengths)


def test_grouped_loader_resumes_at_the_same_sample_on_another_world_size():
    lengths = lengths_for(96)
    two = [shard(lengths, 2, r, 4) for r in range(2)]
    for loader in two:
        loader.set_epoch(2)
    order = [torch.cat([b[0] for b in step]) for step in zip(*two)]
    for loader in two:
        loader.set_epoch(2)  # the finished pass moved them on to epoch 3
    iterators = [iter(loader) for loader in two]
    for it in iterators:
        for _ in range(3):
            next(it)
    state = two[0].state_dict()
    resumed = shard(lengths, 1, 0, 4)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([b[0] for b in resumed]), torch.cat(order[3:]))


def test_accelerator_prepare_recognises_the_sampler():
    lengths = lengths_for(64)
    acc = Accelerator(cpu=True, seed=0)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(64)), batch_size=8,
                                    sampler=LengthGroupedSampler(lengths, 8)))
    batches = [b[0].tolist() for b in loader]
    assert sorted(i for b in batches for i in b) == list(range(64))
    assert loader.batch_sampler.lengths == lengths
