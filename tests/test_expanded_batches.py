"""The engine's one hook for a task that trains on what it makes of its data (``MakesTrainingBatches``, task=grpo):
``Accelerator.expand_batches``. A prepared loader of 5 batches, each made into 3 micro-batches, with gradient
accumulation over 2: the loop sees 15 micro-batches, an optimizer step every 2 and at the epoch's last one only
(the inner loader's last batch would close one at each of its 3), each batch made once with the optimizer step
its first micro-batch trains in; resumed 7 micro-batches in, the partly trained batch's other micro-batches
come from what the task kept, the batches after it are made as before, and nothing is made twice. The window's
metrics with their own item counts (``StepOutput.sample_metric_items``) are means over those counts."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from app.distributed import Accelerator
from app.engine.window_metrics import ITEMS, add_sample_metrics, logged


def expanded(kept: list | None = None):
    acc = Accelerator(gradient_accumulation_steps=2, seed=0)
    loader = acc.prepare(DataLoader(list(range(10)), batch_size=2, drop_last=True, shuffle=False))
    made: list[tuple[list[int], int]] = []

    def make(batch, step):
        made.append((batch.tolist(), step))
        return [{"rows": batch, "part": j} for j in range(3)]

    return acc, acc.expand_batches(loader, make, 3, lambda: kept or []), made


def trained(acc, loader) -> list[tuple[list[int], int, bool, bool]]:
    """Each micro-batch handed out, with whether the optimizer stepped after it and the loader said its end."""
    model = nn.Linear(1, 1)
    seen = []
    for micro in loader:
        with acc.accumulate(model):
            seen.append((micro["rows"].tolist(), micro["part"], acc.sync_gradients, loader.end_of_dataloader))
    return seen


def test_a_loader_batch_becomes_micro_batches_counted_and_accumulated_as_the_loop_counts_them():
    acc, loader, made = expanded()
    assert len(loader) == 15 and loader.batch_size == 2
    seen = trained(acc, loader)
    assert [(rows, part) for rows, part, _, _ in seen] == [([2 * b, 2 * b + 1], j) for b in range(5) for j in range(3)]
    assert [i + 1 for i, (_, _, sync, _) in enumerate(seen) if sync] == [2, 4, 6, 8, 10, 12, 14, 15]
    assert [i + 1 for i, (_, _, _, end) in enumerate(seen) if end] == [15]
    assert made == [([0, 1], 0), ([2, 3], 1), ([4, 5], 3), ([6, 7], 4), ([8, 9], 6)]  # (batch index × 3) // 2
    made.clear()
    seen = trained(acc, loader)  # the next epoch: 8 optimizer steps later
    assert [step for _, step in made] == [8, 9, 11, 12, 14] and len(seen) == 15


def test_resumed_inside_a_batch_its_other_micro_batches_come_from_what_the_task_kept():
    kept = [{"rows": torch.tensor([7, 7]), "part": j} for j in range(3)]
    acc, loader, made = expanded(kept)
    acc.skip_first_batches(loader, 7)  # 2 whole batches and 1 micro-batch of the third trained before the checkpoint
    seen = trained(acc, loader)
    assert [(rows, part) for rows, part, _, _ in seen] == [([7, 7], 1), ([7, 7], 2), ([6, 7], 0), ([6, 7], 1),
                                                          ([6, 7], 2), ([8, 9], 0), ([8, 9], 1), ([8, 9], 2)]
    assert made == [([6, 7], 4), ([8, 9], 6)]  # the partly trained batch is not made again
    assert seen[-1][3] and not any(end for _, _, _, end in seen[:-1])


def test_the_position_counts_micro_batches_handed_out():
    _, loader, _ = expanded()
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    assert loader.position == 4 and loader.state_dict() == {"handed": 1}
    iterator.close()


def test_a_metric_with_its_own_items_is_the_mean_over_them_and_is_left_out_of_a_window_without_any():
    acc = Accelerator()
    sums: dict = {}
    add_sample_metrics(acc, sums, {"kl": torch.tensor([2.0, 4.0]), "reward": torch.tensor([0.5, 0.0])},
                       {"reward": torch.tensor([1, 0])})
    add_sample_metrics(acc, sums, {"kl": torch.tensor([6.0]), "reward": torch.tensor([1.5])}, {"reward": torch.tensor([1])})
    names = tuple(sums)
    assert names == ("kl", "reward", "reward" + ITEMS)
    values = tuple(float(v) for v in sums.values())
    assert logged(names, values, items=4.0) == {"train/kl": 3.0, "train/reward": 1.0}  # 12/4 items; 2/2 rewards
    assert logged(names, (12.0, 0.0, 0.0), items=4.0) == {"train/kl": 3.0}
