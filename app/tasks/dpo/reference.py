"""The reference model's answer log-probabilities, three ways (``task.reference``):

- :class:`FrozenCopy`: a copy of the starting weights (or another model's, ``task.reference=<folder>``),
  frozen, prepared by the runtime as the policy is (device, autocast; under FSDP2 sharded with the same
  units, 1/N on each process); TR-DPO moves it towards the policy (:meth:`FrozenCopy.move_towards`).
- :class:`AdaptersDisabled`: the policy itself with peft's adapters disabled (``disable_adapter()``),
  through the prepared model (DDP, FSDP2, autocast alike).
- :class:`Precomputed`: a table of values, one row (chosen, rejected) per pair of the training and
  evaluation sets, filled by one pass with the starting weights before the first training step, split
  across the processes and completed by one all-reduce. It is registered for checkpointing, so every checkpoint holds it and a resumed run (or ``mode=eval`` of
  a checkpoint) reads it back instead of computing it again.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import TaskRuntime
from app.tasks.dpo.logps import answer_logps

if TYPE_CHECKING:
    from app.tasks.dpo.stream import PairStream

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""(model, batch) -> each row's summed answer log-probability (chosen rows first, then rejected)."""


class FrozenCopy:
    """The starting weights, copied (before any adapter) and frozen, prepared by the runtime as a model
    that only runs forward (``prepare_model(evaluation_mode=True)``): on the device, under the policy's
    autocast (so at the first step it computes exactly what the policy does) and, under FSDP2, sharded
    with the policy's ``fully_shard`` units: each process holds 1/N of it, and its forward is a
    collective that every process runs at every step, as it runs the policy's."""

    def __init__(self, model: nn.Module, runtime: TaskRuntime, copied: bool = True):
        """``copied=False``: ``model`` is the reference's own (loaded for it), frozen as it is."""
        reference = copy.deepcopy(model) if copied else model
        self.model = runtime.prepare_model(reference.requires_grad_(False), evaluation_mode=True)

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        with torch.no_grad():
            return forward(self.model, batch)

    def move_towards(self, policy: nn.Module, alpha: float) -> None:
        """TR-DPO's update ``ref ← α·policy + (1-α)·ref``, parameter by parameter: the copy was taken from
        the policy (before any adapter), so both list their parameters in the same order, and under FSDP2
        both are sharded alike (each process mixes its own shards)."""
        with torch.no_grad():
            for reference, trained in zip(self.model.parameters(), policy.parameters(), strict=True):
                reference.mul_(1 - alpha).add_(trained.detach(), alpha=alpha)


class AdaptersDisabled:
    def __init__(self) -> None:
        self._peft: Any = None

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        if self._peft is None:
            self._peft = peft_model_in(policy)
        with torch.no_grad(), self._peft.disable_adapter():
            return forward(policy, batch)


def peft_model_in(model: nn.Module) -> Any:
    """The peft model inside the prepared model (DDP keeps it as ``.module``; FSDP2 shards it in place)."""
    for module in model.modules():
        if type(module).__module__.startswith("peft.") and hasattr(module, "disable_adapter"):
            return module  # a PeftModel (peft is imported only where adapter=lora put it there)
    raise ConfigError("task.reference=base is the model with its LoRA adapters disabled, and this run has none: "
                      "give adapter=lora, or task.reference=copy, precomputed or a model folder.")


class Precomputed:
    """The table of reference values, ``(pairs, 2)`` float32, one row per pair, and each row's key: the
    ``pair`` the batches carry (map-style: the row number, training pairs first; streamed: the byte
    offset of the pair's line, evaluation pairs -1, -2, …). ``state_dict`` / ``load_state_dict``: see the
    module's docstring.

    The pass is split across the processes: the map-style pairs are cut into batches of ``batch_size``,
    process ``p`` of ``N`` runs batches ``p, p+N, p+2N…`` and writes its rows into a zero-filled table,
    which one all-reduce (a sum: each row is non-zero on one process only, so the sum is exact)
    completes on every process. A streamed training set is read by each process in its own part of the
    file (the part its loader reads), and the parts' values are all-gathered. Every process runs the
    same number of forwards: through DDP (buffers) and FSDP2 (weights) a forward is a collective, so a
    process out of batches runs one again, unkept, while any other still has one."""

    def __init__(self, data_key: str, pair_sets: Sequence[Any], collate: Callable[[list[dict]], dict],
                 batch_size: int, runtime: TaskRuntime, stream: PairStream | None = None):
        self.data_key, self.pair_sets, self.collate, self.batch_size = data_key, pair_sets, collate, batch_size
        self.runtime, self.stream = runtime, stream
        self.table: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None
        """The table's rows' keys, increasing (None: the row numbers themselves)."""
        self.passes = 0
        """Passes this process ran (0 after a resume: the values came from the checkpoint)."""
        self.pairs_computed = 0
        """Pairs whose values this process computed (its share of the pass)."""
        self._on_device: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def state_dict(self) -> dict[str, Any]:
        table = self.table if self.table is not None else torch.empty(0, 2)
        keys = self.keys if self.keys is not None else torch.arange(len(table))
        return {"data": self.data_key, "table": table, "keys": keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["data"] != self.data_key:
            raise ValueError("its reference log-probabilities are for other pairs than this run's")
        table, keys = state["table"], state.get("keys")
        self.table, self._on_device = (table if len(table) else None), None
        self.keys = None if keys is None or torch.equal(keys, torch.arange(len(table))) else keys

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        device = batch["input_ids"].device
        if self.table is None:
            if not policy.training:
                raise ConfigError("task.reference=precomputed: the reference log-probabilities are saved with the "
                                  "run's checkpoints, not with an exported model; evaluate a checkpoint "
                                  "(resume=<run folder>/checkpoints).")
            self.table, self.keys = self.compute(policy, forward, device)
            self._on_device = None
        if self._on_device is None or self._on_device[0].device != device:
            self._on_device = (self.table.to(device), self.keys.to(device) if self.keys is not None else None)
        table, keys = self._on_device
        rows = batch["pair"] if keys is None else torch.searchsorted(keys, batch["pair"]).clamp(max=len(keys) - 1)
        return table[rows].T.flatten()  # chosen rows, then rejected rows

    def compute(self, model: nn.Module, forward: Forward,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over every pair with the model as it is (the starting weights), in evaluation mode,
        this process's share of it; the whole table (and its keys) on every process."""
        sizes = [len(pairs) for pairs in self.pair_sets]
        world, rank = self.runtime.num_processes, self.runtime.process_index
        batches = [(pairs, start, sum(sizes[:i])) for i, pairs in enumerate(self.pair_sets)
                   for start in range(0, len(pairs), self.batch_size)]
        shares = [sum(min(self.batch_size, len(p) - s) for p, s, _ in batches[r::world]) for r in range(world)]
        split = f", split over {world} processes" if world > 1 else ""
        if self.stream is None:
            split += f": {', '.join(f'{n:,}' for n in shares)} pairs" if world > 1 else ""
            what = " + ".join(f"{n:,}" for n in sizes)
        else:
            what = f"the pairs streamed from {self.stream.path} (each process its part) + {sum(sizes):,}"
        log.info("reference log-probabilities: one pass over %s pairs with the starting weights "
                 "(task.reference=precomputed)%s", what, split)
        table = torch.zeros(sum(sizes), 2, device=device)
        streamed: list[tuple[torch.Tensor, torch.Tensor]] = []
        own = self._own_batches(batches[rank::world])
        spare = self._rows(*batches[0][:2])  # a process out of batches runs one again (its peers need it)
        model.eval()
        try:
            with torch.no_grad():
                while True:
                    item = next(own, None)
                    more = item is not None
                    if world > 1:  # on while any process has a batch left
                        more = float(self.runtime.reduce(torch.tensor([float(more)], device=device), "max")) > 0
                    if not more:
                        break
                    rows, first = item if item is not None else (spare, None)
                    batch = {key: v.to(device) for key, v in self.collate(rows).items()}
                    values = forward(model, batch).view(2, -1).T.float()
                    if item is None:
                        continue
                    spare = rows
                    self.pairs_computed += len(rows)
                    if first is None:
                        streamed.append((batch["pair"].cpu(), values.cpu()))
                    else:
                        table[first:first + len(rows)] = values
        finally:
            model.train()
        if world > 1:
            table = self.runtime.reduce(table, "sum")
        self.passes += 1
        if self.stream is None:
            return table.cpu(), None
        # The map-style rows are the same table on every process; each process's streamed rows, its own.
        mine = (torch.cat([k for k, _ in streamed]) if streamed else torch.empty(0, dtype=torch.int64),
                torch.cat([v for _, v in streamed]) if streamed else torch.empty(0, 2))
        parts = self.runtime.gather_object([mine])
        keys = torch.cat([torch.tensor(list(pairs["pair"]), dtype=torch.int64) for pairs in self.pair_sets]
                         + [k for k, _ in parts])
        values = torch.cat([table.cpu(), *(v for _, v in parts)])
        order = torch.argsort(keys)
        return values[order], keys[order]

    def _rows(self, pairs: Any, start: int) -> list[dict[str, Any]]:
        columns = pairs[start:start + self.batch_size]
        return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]

    def _own_batches(self, mine: list[tuple[Any, int, int]]) -> Iterator[tuple[list[dict[str, Any]], int | None]]:
        """This process's batches: its share of the map-style ones (with the table row of their first
        pair), then its part of the stream (None: keyed by their ``pair``)."""
        for pairs, start, offset in mine:
            yield self._rows(pairs, start), offset + start
        if self.stream is not None:
            items = iter(self.stream.from_the_start())
            while rows := list(itertools.islice(items, self.batch_size)):
                yield rows, None


def logps_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed answer log-probability (chosen rows, then rejected)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
    return answer_logps(logits, batch["labels"])[0]
