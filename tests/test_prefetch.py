"""Input prefetch (``app/distributed/data/prefetch.py``): a background thread loads and places batches
ahead of the loop, which sees the same batches in the same order, with the same end-of-epoch marks,
as without it. On CPU with a placing function that records its thread (the XLA backend's is
``place_batch``; tests/test_xla.py runs it there)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app.distributed.data.map_style import shard_dataloader
from app.distributed.data.prefetch import prefetched
from app.distributed.state import GradientState


def test_prefetched_places_in_a_background_thread_in_order_and_at_most_depth_ahead():
    consumer = threading.get_ident()
    placed: list[tuple[int, int]] = []  # (batch, thread)
    handed: list[int] = []

    def place(batch: int) -> int:
        placed.append((batch, threading.get_ident()))
        return batch * 10

    for value in prefetched(iter(range(6)), place, depth=2):
        handed.append(value)
        # The thread may be at most the queue's depth plus the batch it holds ahead of the consumer.
        assert len(placed) <= len(handed) + 3
    assert handed == [0, 10, 20, 30, 40, 50]
    assert [b for b, _ in placed] == list(range(6)) and {t for _, t in placed} != {consumer}


def test_prefetched_raises_a_loading_error_at_its_batch_and_a_closed_one_stops_its_thread():
    def batches():
        yield 1
        raise ValueError("sample 7 is corrupt")

    ahead = prefetched(batches(), lambda b: b, depth=2)
    assert next(ahead) == 1  # the batch before the error still comes
    with pytest.raises(ValueError, match="sample 7 is corrupt"):
        next(ahead)

    before = {t.ident for t in threading.enumerate()}
    endless = prefetched(iter(range(10**9)), lambda b: b, depth=2)
    assert next(endless) == 0
    endless.close()  # a loop that stops early: the thread ends, it does not run on
    assert all(t.name != "device-prefetch" for t in threading.enumerate() if t.ident not in before)


@pytest.mark.parametrize("stop_early", [False, True])
def test_a_prefetching_loader_yields_what_the_plain_one_does_with_the_same_epoch_end(stop_early):
    data = TensorDataset(torch.arange(40).float())

    def epoch(prefetch: int) -> list[tuple[list[float], bool]]:
        threads: set[int] = set()

        def place(batch):
            threads.add(threading.get_ident())
            return [t + 0 for t in batch]

        loader = shard_dataloader(DataLoader(data, batch_size=6, shuffle=True), device=torch.device("cpu"),
                                  state=GradientState(), num_processes=1, process_index=0, seed=3,
                                  even_batches=True, split_batches=False, place=place, prefetch=prefetch)
        out = []
        for (batch,) in loader:
            out.append((batch.tolist(), loader.end_of_dataloader))
            if stop_early and len(out) == 3:
                break  # a stop inside the epoch: the next pass starts the next epoch's order
        assert (threading.get_ident() in threads) is (prefetch == 0)
        return out

    plain, ahead = epoch(0), epoch(2)
    assert ahead == plain
    if not stop_early:
        assert [last for _, last in ahead] == [False] * 6 + [True]
