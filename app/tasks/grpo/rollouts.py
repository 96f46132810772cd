"""One generation batch, whole: every process's prompts and completions in global order (process 0's prompts
first, each prompt's ``G`` completions in a row), the reward table, the advantages and, where the batch is
trained on over several optimizer steps, the log-probabilities its completions had when generated.

Every process holds the same :class:`Rollouts` (gathered once per generation batch), so that the advantages
and TRL's metrics are computed from the same numbers in the same order on every process (bit-identical for
any number of processes), the main process can write ``completions.jsonl``, and a checkpoint (written by the
main process) holds what is not yet trained on: :class:`GenerationBuffer` is registered for checkpointing,
and a resumed run rebuilds its micro-batches from it instead of generating again. Each process trains on its
own prompts' completions, cut into micro-batches of ``trainer.batch_size`` prompts (:func:`micro_batches`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.tasks.causal_lm.batches import IGNORE_INDEX

GENERATION_METRICS_KEY = "generation_metrics"
"""A micro-batch's per-generation-batch metrics: in the first micro-batch of a generation batch only."""


@dataclass
class Rollouts:
    """A generation batch (see the module's docstring); lists are per prompt or per completion, in global order."""

    step: int
    """The optimizer step whose key drew the completions (``sampling.row_keys``)."""
    world: int
    """The processes it was made by (each made ``len(prompt_index) / world`` prompts' completions)."""
    prompt_index: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    """Each completion's tokens, its stop token included (no padding)."""
    truncated: list[bool]
    """Cut at task.max_completion_length without a stop token."""
    table: torch.Tensor
    """``(completions, rewards)`` float32, NaN: no opinion."""
    advantages: torch.Tensor
    rewards: torch.Tensor
    """Each completion's weighted reward (NaN: unscored)."""
    metrics: dict[str, float]
    """TRL's reward and length metrics of the batch and its time split (``train/<name>`` once per batch)."""
    old_logps: torch.Tensor | None = None
    """``(completions, longest completion)`` float32: the policy's log-probabilities of the completion tokens at
    generation, when the batch is trained on after an optimizer step (else the ratio is 1 by construction)."""

    @property
    def num_generations(self) -> int:
        return len(self.completion_ids) // len(self.prompt_index)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step, "world": self.world, "prompt_index": self.prompt_index, "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids, "truncated": self.truncated, "table": self.table.contiguous(),
            "advantages": self.advantages.contiguous(), "rewards": self.rewards.contiguous(),
            "metrics": self.metrics}
        if self.old_logps is not None:
            state["old_logps"] = self.old_logps.contiguous()
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollouts:
        return cls(int(state["step"]), int(state["world"]), [int(i) for i in state["prompt_index"]],
                   [list(map(int, ids)) for ids in state["prompt_ids"]],
                   [list(map(int, ids)) for ids in state["completion_ids"]], [bool(t) for t in state["truncated"]],
                   state["table"], state["advantages"], state["rewards"], dict(state["metrics"]),
                   state.get("old_logps"))


@dataclass
class GenerationBuffer:
    """The latest generation batch, checkpointed with the run (``register_for_checkpointing``), and where
    ``completions.jsonl`` stood at the save: a resumed run cuts it back there (the lines of generation batches
    made after the checkpoint are written again as they are made again), keeping those of the buffered batch."""

    completions_file: Path | None = None
    """Written by the main process only (None on the others, and without a run folder)."""
    current: Rollouts | None = None
    _cut_to: int | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        file = self.completions_file
        size = file.stat().st_size if file is not None and file.exists() else -1
        return {"rollouts": None if self.current is None else self.current.state_dict(), "completions_bytes": size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rollouts = state.get("rollouts")
        self.current = None if rollouts is None else Rollouts.from_state(rollouts)
        size = int(state.get("completions_bytes", -1))
        file = self.completions_file
        if file is not None and size >= 0 and file.exists() and file.stat().st_size > size:
            with open(file, "r+b") as f:
                f.truncate(size)

    def append(self, lines: list[dict[str, Any]]) -> None:
        if self.completions_file is None or not lines:
            return
        with open(self.completions_file, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


@dataclass(frozen=True)
class Layout:
    """How a generation batch is cut: ``batch_size`` prompts per micro-batch, ``slices`` micro-batches per
    process (task.steps_per_generation), trained ``iterations`` times (task.num_iterations)."""

    batch_size: int
    slices: int
    iterations: int


def micro_batches(rollouts: Rollouts, process: int, layout: Layout, pad_id: int, mask_truncated: bool,
                  metric_names: tuple[str, ...]) -> list[dict[str, Any]]:
    """This process's micro-batches of a generation batch, in training order (its slices, ``iterations``
    times): :func:`micro_batch` of each slice's prompts; the first carries the batch's metrics."""
    share = len(rollouts.prompt_index) // rollouts.world
    made = []
    for iteration in range(layout.iterations):
        for s in range(layout.slices):
            first = process * share + s * layout.batch_size
            prompts = range(first, first + layout.batch_size)
            metrics = rollouts.metrics if iteration == 0 and s == 0 else {}
            made.append(micro_batch(rollouts, prompts, pad_id, mask_truncated,
                                    {name: metrics.get(name) for name in metric_names}))
    return made


def micro_batch(rollouts: Rollouts, prompts: range, pad_id: int, mask_truncated: bool,
                metrics: dict[str, float | None]) -> dict[str, Any]:
    """The ``G`` completions of each of these prompts (positions in the batch), as one training batch:
    ``input_ids`` (prompts left-padded to the longest, completions right-padded to the longest),
    ``attention_mask``, ``position_ids`` (counted from each row's first token, as generation counted them),
    ``labels`` (the completion tokens; -100 elsewhere), ``completion_start`` (the prompts' padded length),
    ``completion_mask`` (0 for a truncated completion with task.mask_truncated_completions), ``advantages``,
    ``old_logps`` where the batch has them, and ``generation_metrics`` (None: not in this micro-batch)."""
    g = rollouts.num_generations
    rows = [p * g + k for p in prompts for k in range(g)]
    prompt_ids = [rollouts.prompt_ids[r // g] for r in rows]
    completion_ids = [rollouts.completion_ids[r] for r in rows]
    width, length = max(len(p) for p in prompt_ids), max(len(c) for c in completion_ids)
    input_ids = torch.full((len(rows), width + length), pad_id, dtype=torch.int64)
    attention = torch.zeros_like(input_ids)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        input_ids[i, width - len(prompt):width] = torch.tensor(prompt, dtype=torch.int64)
        input_ids[i, width:width + len(completion)] = torch.tensor(completion, dtype=torch.int64)
        attention[i, width - len(prompt):width + len(completion)] = 1
    completion_mask = attention[:, width:].clone()
    if mask_truncated:
        truncated = torch.tensor([rollouts.truncated[r] for r in rows])
        completion_mask[truncated] = 0
    labels = input_ids.masked_fill(attention == 0, IGNORE_INDEX)
    labels[:, :width] = IGNORE_INDEX
    batch: dict[str, Any] = {
        "input_ids": input_ids, "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0), "labels": labels, "completion_start": width,
        "completion_mask": completion_mask, "advantages": rollouts.advantages[rows].clone(),
        GENERATION_METRICS_KEY: metrics}
    if rollouts.old_logps is not None:
        batch["old_logps"] = rollouts.old_logps[rows, :length].clone()
    return batch
