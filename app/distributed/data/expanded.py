"""A prepared training loader whose every batch becomes several micro-batches (``Accelerator.expand_batches``):
a task that trains on what it makes of its data (``task=grpo``: a batch of prompts -> completions generated,
scored and cut into micro-batches) is driven by the same loop as any other, which iterates micro-batches.

What the loop and the checkpoints see is counted in micro-batches: ``len()`` is the inner loader's batches
times ``per_batch``, ``position`` the micro-batches handed out in the epoch, ``skip_first_batches(n)`` resumes
``n`` micro-batches into it. A batch is drawn from the inner loader when its first micro-batch is needed, so the
inner loader's own checkpointed position counts it as drawn; the micro-batches of a batch not wholly handed
out at a save are the task's to keep (``pending``: rebuilt from what the task checkpoints), not drawn again.

Gradient accumulation reads ``end_of_dataloader`` from the innermost loader being iterated: this one puts
itself there, true only at the last micro-batch of the inner loader's last batch (the inner loader says it
at its last batch, which would close an optimizer step at every one of that batch's micro-batches). Its
``remainder`` is -1: the inner loader drops an incomplete last batch (no duplicates to leave out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from app.distributed.operations import send_to_device
from app.distributed.state import GradientState

MakeBatches = Callable[[Any, int], list[Any]]
"""(an inner batch, the optimizer step its first micro-batch trains in) -> its ``per_batch`` micro-batches."""


class ExpandedLoader:
    """The micro-batches of a prepared loader's batches, in order; see the module's docstring."""

    def __init__(self, loader: Any, make: MakeBatches, per_batch: int, pending: Callable[[], list[Any]],
                 state: GradientState, accumulation: int, device: Any, batch_size: int):
        if per_batch < 1:
            raise ValueError(f"per_batch must be at least 1, got {per_batch}")
        self.loader, self.make, self.per_batch, self.pending = loader, make, per_batch, pending
        self.gradient_state, self.accumulation, self.device = state, accumulation, device
        self.batch_size = batch_size
        """The samples a micro-batch holds."""
        self.handed = 0
        """Micro-batches of the latest drawn batch handed out (0 before the epoch's first)."""
        self._skip: int | None = None
        self.end_of_dataloader = False
        self.remainder = -1

    def __len__(self) -> int:
        return len(self.loader) * self.per_batch

    @property
    def epoch(self) -> int:
        return int(self.loader.epoch)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.loader.epoch:
            self.handed = 0
        self.loader.set_epoch(epoch)

    @property
    def total_dataset_length(self) -> int:
        return int(self.loader.total_dataset_length)

    @property
    def position(self) -> int:
        """Micro-batches of the current epoch handed out (the inner loader's drawn batches, the last one
        counted by what of it was handed out)."""
        drawn = int(self.loader.position)
        return 0 if drawn == 0 else (drawn - 1) * self.per_batch + (self.handed or self.per_batch)

    def state_dict(self) -> dict[str, int]:
        return {"handed": self.handed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.handed = int(state["handed"])

    def skip_first_batches(self, num_batches: int) -> ExpandedLoader:
        """The next iteration starts ``num_batches`` micro-batches into the epoch: whole inner batches are
        skipped unread; the rest of one partly trained comes from ``pending``."""
        self._skip = num_batches
        return self

    def step_of(self, batch_index: int) -> int:
        """The optimizer step that trains on the first micro-batch of the epoch's ``batch_index``-th inner
        batch: the epochs before (each ``ceil(len / accumulation)`` steps, the last one shorter) and the
        micro-batches before it in this one."""
        per_epoch = math.ceil(len(self) / self.accumulation)
        return self.epoch * per_epoch + (batch_index * self.per_batch) // self.accumulation

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip or 0, None
        whole, part = divmod(skip, self.per_batch)
        inner_batches = len(self.loader)
        self.end_of_dataloader = False
        state = self.gradient_state
        try:
            if part:
                # A batch partly trained before the checkpoint: its other micro-batches, as the task kept them.
                rest = self.pending()[part:]
                self._skip_inner(whole + 1)
                last_batch = whole + 1 == inner_batches
                for j, micro in enumerate(rest):
                    self.handed = part + j + 1
                    self._on_top(state, last_batch and j == len(rest) - 1)
                    yield self._placed(micro)
            elif whole:
                self._skip_inner(whole)
            for batch in self.loader:
                index = int(self.loader.position) - 1
                micro_batches = self.make(batch, self.step_of(index))
                if len(micro_batches) != self.per_batch:
                    raise RuntimeError(f"a batch made {len(micro_batches)} micro-batches, not {self.per_batch}")
                at_end = bool(self.loader.end_of_dataloader)
                for j, micro in enumerate(micro_batches):
                    self.handed = j + 1
                    self._on_top(state, at_end and j == self.per_batch - 1)
                    yield self._placed(micro)
            self.handed = 0
        finally:
            if self in state.active:
                state.active.remove(self)
            self.end_of_dataloader = False

    def _skip_inner(self, batches: int) -> None:
        from app.distributed.data.map_style import skip_first_batches

        skip_first_batches(self.loader, batches)

    def _on_top(self, state: GradientState, last: bool) -> None:
        """This loader innermost in the gradient state (the inner one pushes itself when it starts), its
        end flag set for the micro-batch about to be handed out."""
        self.end_of_dataloader = last
        if state.active and state.active[-1] is self:
            return
        if self in state.active:
            state.active.remove(self)
        state.active.append(self)

    def _placed(self, micro: Any) -> Any:
        return micro if self.device is None else send_to_device(micro, self.device)
