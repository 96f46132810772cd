"""What a task may ask of the loop around its optimizer steps: totals over the whole step before any of
it is trained (``app.tasks.base.ReadsStepTotals``: KTO's KL estimate, the token count an NLL term averages
over), and an update of its own after each step (``app.tasks.base.AfterOptimizerStep``: :func:`after_step_hook`).

The loop stays the one loop: it iterates micro-batches as ever, from :func:`with_step_totals`, which
draws the micro-batches of the next optimizer step (``gradient_accumulation_steps`` of them, fewer at
the end of a pass), sums the task's per-sample ``step_sums`` over them without gradients, reduces the
sums across processes (one all-reduce per step) and gives them to the task's ``begin_step``, then hands
the micro-batches on one by one. A batch's place in its pass is what the loader says while it is the
current one (``end_of_dataloader``, whose step synchronises, and ``remainder``, the duplicates that
complete the last global batch): the loader set them when the batch was drawn, and they are set back
to those values while the batch is summed and while it is trained, so ``accumulate`` and
``local_for_metrics`` see what they would have seen without the look ahead. The loader stays active
until its last batch has been trained (its pass is not run to its end before)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from app.distributed import Accelerator
from app.tasks.base import AfterOptimizerStep, ReadsStepTotals


class Drawn(NamedTuple):
    """A micro-batch and where its loader stood when it was drawn."""

    batch: Any
    loader: Any
    end_of_dataloader: bool
    remainder: int

    def current(self) -> Any:
        """Put the loader back where it stood for this batch; the batch."""
        self.loader.end_of_dataloader, self.loader.remainder = self.end_of_dataloader, self.remainder
        return self.batch


def optimizer_steps(batches: Iterable[Any], acc: Accelerator) -> Iterator[list[Drawn]]:
    """The micro-batches grouped as ``accumulate`` groups them into optimizer steps: ``k`` at a time
    from the pass's start (a resumed pass starts at a step's start), the pass's last batch closing a
    step of its own."""
    state, size = acc.gradient_state, acc.gradient_accumulation_steps
    step: list[Drawn] = []
    for batch in batches:
        loader = state.active_dataloader
        step.append(Drawn(batch, loader, bool(loader.end_of_dataloader), int(loader.remainder)))
        if len(step) == size or loader.end_of_dataloader:
            yield step
            step = []
    if step:
        yield step


def with_step_totals(batches: Iterable[Any], acc: Accelerator, task: Any, model: nn.Module) -> Iterable[Any]:
    """``batches``, each optimizer step's handed on after ``task.begin_step`` has its totals; as they are
    for a task that reads none."""
    if isinstance(task, ReadsStepTotals) and task.reads_step_totals:
        return _with_totals(batches, acc, task, model)
    return batches


def _with_totals(batches: Iterable[Any], acc: Accelerator, task: ReadsStepTotals, model: nn.Module) -> Iterator[Any]:
    for step in optimizer_steps(batches, acc):
        totals: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for drawn in step:
                rows = acc.local_for_metrics(task.step_sums(model, drawn.current()))
                for name, values in rows.items():
                    total = values.detach().float().sum()
                    totals[name] = totals[name] + total if name in totals else total
        if acc.num_processes > 1:
            names = tuple(totals)
            totals = dict(zip(names, acc.reduce(torch.stack([totals[n] for n in names])).unbind(), strict=True))
        task.begin_step(totals)
        for drawn in step:
            yield drawn.current()


def after_step_hook(task: Any, model: nn.Module, state: Any) -> Callable[[], None] | None:
    """What the loop runs after every optimizer step for the task (``state.global_step``: the steps taken,
    counted already); None for a task that updates nothing of its own."""
    if not isinstance(task, AfterOptimizerStep):
        return None
    return lambda: task.after_optimizer_step(model, state.global_step)
