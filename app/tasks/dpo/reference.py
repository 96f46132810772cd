"""The reference model's answer log-probabilities, three ways (``task.reference``):

- :class:`FrozenCopy`: a copy of the starting weights, frozen, moved to the batch's device at its
  first use (the policy's precision autocast does not wrap it: it runs in the weights' dtype).
- :class:`AdaptersDisabled`: the policy itself with peft's adapters disabled (``disable_adapter()``),
  through the prepared model (DDP, FSDP2, autocast alike).
- :class:`Precomputed`: a table of values, one row (chosen, rejected) per pair of the training and
  evaluation sets, filled by one pass with the starting weights before the first training step. It
  is registered for checkpointing, so every checkpoint holds it and a resumed run (or ``mode=eval`` of
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
from app.tasks.dpo.loss import answer_logps

log = logging.getLogger(__name__)

Forward = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
"""(model, batch) -> each row's summed answer log-probability (chosen rows first, then rejected)."""


class FrozenCopy:
    def __init__(self, model: nn.Module):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    def __call__(self, policy: nn.Module, batch: dict[str, torch.Tensor], forward: Forward) -> torch.Tensor:
        device = batch["input_ids"].device
        if next(self.model.parameters()).device != device:
            self.model.to(device)
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
    pair's row number, ``pair``). ``state_dict`` / ``load_state_dict``: see the module's docstring."""

    def __init__(self, data_key: str, pair_sets: Sequence[Any], collate: Callable[[list[dict]], dict],
                 batch_size: int):
        self.data_key, self.pair_sets, self.collate, self.batch_size = data_key, pair_sets, collate, batch_size
        self.table: torch.Tensor | None = None
        self.passes = 0
        """Passes this process ran (0 after a resume: the values came from the checkpoint)."""
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
        """One pass over every pair with the model as it is (the starting weights), in evaluation mode."""
        sizes = [len(pairs) for pairs in self.pair_sets]
        log.info("reference log-probabilities: one pass over %s pairs with the starting weights "
                 "(task.reference=precomputed)", " + ".join(f"{n:,}" for n in sizes))
        table = torch.empty(sum(sizes), 2)
        model.eval()
        try:
            with torch.no_grad():
                for pairs in self.pair_sets:
                    for start in range(0, len(pairs), self.batch_size):
                        columns = pairs[start:start + self.batch_size]
                        rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
                        batch = {k: v.to(device) for k, v in self.collate(rows).items()}
                        values = forward(model, batch).view(2, -1).T.float().cpu()
                        table[batch["pair"].cpu()] = values
        finally:
            model.train()
        self.passes += 1
        return table


def logps_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed answer log-probability (chosen rows, then rejected)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
    return answer_logps(logits, batch["labels"])[0]
