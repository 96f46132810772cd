"""The reference model's answer log-probabilities, three ways (``task.reference``):

- :class:`FrozenCopy`: a copy of the starting weights, frozen, prepared by the runtime as the policy
  is (device, autocast; under FSDP2 sharded with the same units, 1/N on each process).
- :class:`AdaptersDisabled`: the policy itself with peft's adapters disabled (``disable_adapter()``),
  through the prepared model (DDP, FSDP2, autocast alike).
- :class:`Precomputed`: a table of values, one row (chosen, rejected) per pair of the training and
  evaluation sets, filled by one pass with the starting weights before the first training step, split
  across the processes and completed by one all-reduce. It is registered for checkpointing, so every checkpoint holds it and a resumed run (or ``mode=eval`` of
  a checkpoint) reads it back instead of computing it again.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from app.config import ConfigError
from app.tasks.base import TaskRuntime
from app.tasks.dpo.loss import answer_logps

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""(model, batch) -> each row's summed answer log-probability (chosen rows first, then rejected)."""


class FrozenCopy:
    """The starting weights, copied (before any adapter) and frozen, prepared by the runtime as a model
    that only runs forward (``prepare_model(evaluation_mode=True)``): on the device, under the policy's
    autocast (so at the first step it computes exactly what the policy does) and, under FSDP2, sharded
    with the policy's ``fully_shard`` units: each process holds 1/N of it, and its forward is a
    collective that every process runs at every step, as it runs the policy's."""

    def __init__(self, model: nn.Module, runtime: TaskRuntime):
        self.model = runtime.prepare_model(copy.deepcopy(model).requires_grad_(False), evaluation_mode=True)

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        with torch.no_grad():
            return forward(self.model, batch)


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
                      "give adapter=lora, or task.reference=copy or precomputed.")


class Precomputed:
    """The table of reference values, ``(pairs, 2)`` float32, training pairs first (the batches carry each
    pair's row number, ``pair``). ``state_dict`` / ``load_state_dict``: see the module's docstring.

    The pass is split across the processes: the pairs are cut into batches of ``batch_size``, process
    ``p`` of ``N`` runs batches ``p, p+N, p+2N…`` and writes its rows into a zero-filled table, which one
    all-reduce (a sum: each row is non-zero on one process only, so the sum is exact) completes on every
    process. Every process runs the same number of forwards: through DDP (buffers) and FSDP2 (weights)
    a forward is a collective, so a process short of a batch runs one of its own again, unkept."""

    def __init__(self, data_key: str, pair_sets: Sequence[Any], collate: Callable[[list[dict]], dict],
                 batch_size: int, runtime: TaskRuntime):
        self.data_key, self.pair_sets, self.collate, self.batch_size = data_key, pair_sets, collate, batch_size
        self.runtime = runtime
        self.table: torch.Tensor | None = None
        self.passes = 0
        """Passes this process ran (0 after a resume: the values came from the checkpoint)."""
        self.pairs_computed = 0
        """Pairs whose values this process computed (its share of the pass)."""
        self._on_device: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data_key, "table": self.table if self.table is not None else torch.empty(0, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["data"] != self.data_key:
            raise ValueError("its reference log-probabilities are for other pairs than this run's")
        table = state["table"]
        self.table, self._on_device = (table if len(table) else None), None

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        if self.table is None:
            if not policy.training:
                raise ConfigError("task.reference=precomputed: the reference log-probabilities are saved with the "
                                  "run's checkpoints, not with an exported model; evaluate a checkpoint "
                                  "(resume=<run folder>/checkpoints).")
            self.table = self.compute(policy, forward, batch["input_ids"].device)
        if self._on_device is None or self._on_device.device != batch["input_ids"].device:
            self._on_device = self.table.to(batch["input_ids"].device)
        return self._on_device[batch["pair"]].T.flatten()  # chosen rows, then rejected rows

    def compute(self, model: nn.Module, forward: Forward, device: torch.device) -> torch.Tensor:
        """One pass over every pair with the model as it is (the starting weights), in evaluation mode,
        this process's share of it; the whole table on every process."""
        sizes = [len(pairs) for pairs in self.pair_sets]
        batches = [(pairs, start) for pairs in self.pair_sets for start in range(0, len(pairs), self.batch_size)]
        world, rank = self.runtime.num_processes, self.runtime.process_index
        shares = [sum(min(self.batch_size, len(p) - s) for p, s in batches[r::world]) for r in range(world)]
        log.info("reference log-probabilities: one pass over %s pairs with the starting weights "
                 "(task.reference=precomputed)%s", " + ".join(f"{n:,}" for n in sizes),
                 f", split over {world} processes: {', '.join(f'{n:,}' for n in shares)} pairs" if world > 1 else "")
        mine = batches[rank::world]
        rounds = -(-len(batches) // world)
        table = torch.zeros(sum(sizes), 2, device=device)
        model.eval()
        try:
            with torch.no_grad():
                for k in range(rounds):
                    # Past its share, a process runs its last batch again (or the first): its peers need the forward.
                    pairs, start = mine[min(k, len(mine) - 1)] if mine else batches[0]
                    columns = pairs[start:start + self.batch_size]
                    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
                    batch = {key: v.to(device) for key, v in self.collate(rows).items()}
                    values = forward(model, batch).view(2, -1).T.float()
                    if k < len(mine):
                        table[batch["pair"]] = values
                        self.pairs_computed += len(rows)
        finally:
            model.train()
        if world > 1:
            table = self.runtime.reduce(table, "sum")
        self.passes += 1
        return table.cpu()


def logps_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed answer log-probability (chosen rows, then rejected)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
    return answer_logps(logits, batch["labels"])[0]
