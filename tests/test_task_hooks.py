"""The engine's two task hooks around optimizer steps (``app/engine/task_hooks.py``): a task that reads
its step's totals gets, before each step's first micro-batch, the sums over exactly that step's
micro-batches (``gradient_accumulation_steps`` of them, the pass's last step shorter), while the
micro-batches are trained in the same order with the same synchronisation as without the look ahead
(the loader's flags are those of the batch being trained); a task without the hook gets its batches as
they are; an after-step hook runs with the step count."""

from __future__ import annotations

import types

import torch
from torch.utils.data import DataLoader

from app.distributed import Accelerator
from app.engine.task_hooks import after_step_hook, with_step_totals


class Totals:
    reads_step_totals = True

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def step_sums(self, model, batch):
        assert not torch.is_grad_enabled()
        self.events.append(("sum", batch.tolist()))
        return {"values": batch.float(), "samples": torch.ones(len(batch))}

    def begin_step(self, totals):
        self.events.append(("begin", {k: float(v) for k, v in totals.items()}))


def trained(acc: Accelerator, batches) -> list[tuple[list[int], bool, bool]]:
    """What a loop sees: each batch, whether its step synchronises, whether the loader marks it last."""
    seen = []
    model = torch.nn.Linear(1, 1)
    for batch in batches:
        with acc.accumulate(model):
            seen.append((batch.tolist(), acc.sync_gradients, acc.gradient_state.end_of_dataloader))
    return seen


def test_each_step_is_totalled_before_its_batches_and_trained_as_without_the_look_ahead():
    plain = Accelerator(gradient_accumulation_steps=3)
    expected = trained(plain, plain.prepare_data_loader(DataLoader(list(range(14)), batch_size=2)))
    acc = Accelerator(gradient_accumulation_steps=3)
    loader = acc.prepare_data_loader(DataLoader(list(range(14)), batch_size=2))
    task = Totals()
    seen = []
    model = torch.nn.Linear(1, 1)
    for batch in with_step_totals(loader, acc, task, model):
        task.events.append(("train", batch.tolist()))
        with acc.accumulate(model):
            seen.append((batch.tolist(), acc.sync_gradients, acc.gradient_state.end_of_dataloader))
    assert seen == expected and [s for _, s, _ in seen] == [False, False, True] * 2 + [True]
    steps = [[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10, 11]], [[12, 13]]
    events = []
    for step in steps:
        events += [("sum", b) for b in step]
        events.append(("begin", {"values": float(sum(sum(b) for b in step)), "samples": float(2 * len(step))}))
        events += [("train", b) for b in step]
    assert task.events == events
    assert not acc.gradient_state.in_dataloader  # the pass ran to its end


def test_a_task_without_totals_gets_its_batches_untouched_and_after_step_runs_with_the_count():
    acc = Accelerator()
    batches = [torch.tensor([1])]
    assert with_step_totals(batches, acc, object(), torch.nn.Linear(1, 1)) is batches
    off = Totals()
    off.reads_step_totals = False
    assert with_step_totals(batches, acc, off, torch.nn.Linear(1, 1)) is batches
    calls = []
    task = types.SimpleNamespace(after_optimizer_step=lambda model, step: calls.append((model, step)))
    state = types.SimpleNamespace(global_step=0)
    hook = after_step_hook(task, "model", state)
    state.global_step = 3
    hook()
    assert calls == [("model", 3)] and after_step_hook(object(), "model", state) is None
