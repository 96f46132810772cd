"""A batch of prompts -> its completions, their rewards and (training) the whole generation batch gathered:
``sampling.generate`` with the current weights (evaluation mode; a DDP model's own module, which runs
without collectives; a sharded model on every process in step), each completion keyed by (seed, step, the
prompt's index, k), then ``rewards.score`` on this process's completions, then one all-gather of every
process's prompts, completions and scores (or the sentence refusing them, which every process then raises
alike), from which every process computes the same advantages and metrics (``advantages.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.config import InputError
from app.tasks.base import TaskRuntime
from app.tasks.grpo.advantages import group_advantages, reward_metrics, reward_table, summed_rewards
from app.tasks.grpo.config import GRPOConfig
from app.tasks.grpo.rewards import Reward, score, unscored_sentence
from app.tasks.grpo.rollouts import Rollouts
from app.tasks.grpo.sampling import Sampling, generate, row_keys

EVALUATION_STEP = -1
"""The step of every evaluation's keys: each evaluation draws the same noise, so that two evaluations differ
by their weights only."""


@dataclass
class Prompts:
    """A batch of prompts as the loader gives them (``PromptCollator``)."""

    index: list[int]
    prompt_ids: list[list[int]]
    prompt: list[Any]
    """As the data has it: a string, or messages."""
    columns: list[dict[str, Any]]

    @classmethod
    def of(cls, batch: dict[str, Any]) -> Prompts:
        return cls([int(i) for i in batch["index"].tolist()], batch["prompt_ids"],
                   [json.loads(p) for p in batch["prompt"]], [json.loads(c) for c in batch["columns"]])


def generation_model(model: nn.Module) -> nn.Module:
    """What generates: a DDP model's own module (DDP's forward would broadcast buffers, a collective at every
    decoding step of processes that decode for different numbers of steps); any other model as it is."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class RolloutMaker:
    """Generates and scores for ``task=grpo`` (see the module's docstring)."""

    def __init__(self, cfg: GRPOConfig, tokenizer: Any, rewards: Sequence[Reward], runtime: TaskRuntime, seed: int,
                 stop_ids: list[int], pad_id: int):
        self.cfg, self.tokenizer, self.rewards, self.runtime = cfg, tokenizer, list(rewards), runtime
        self.seed, self.stop_ids, self.pad_id = seed, stop_ids, pad_id
        self.sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
        self.weights = torch.tensor([r.spec.weight for r in self.rewards], dtype=torch.float32)
        self.names = [r.spec.name for r in self.rewards]

    # -- generation ----------------------------------------------------------------------------------------

    def complete(self, model: nn.Module, prompts: Prompts, step: int,
                 chunk: int | None = None) -> tuple[list[list[int]], list[bool]]:
        """``G`` completions of each prompt (prompt-major), ``chunk`` prompts per generation call (None: all),
        and whether each was cut at task.max_completion_length."""
        g, chunk = self.cfg.num_generations, chunk or max(1, len(prompts.index))
        generator = generation_model(model)
        sync = self._all_done if self.runtime.shards_the_model and self.runtime.num_processes > 1 else None
        was_training = model.training
        model.eval()
        completions: list[list[int]] = []
        truncated: list[bool] = []
        try:
            for start in range(0, len(prompts.index), chunk):
                index = prompts.index[start:start + chunk]
                keys = row_keys(self.seed, step, [i for i in index for _ in range(g)], [k for _ in index for k in range(g)])
                rows = [ids for ids in prompts.prompt_ids[start:start + chunk] for _ in range(g)]
                out = generate(generator, rows, keys, self.sampling, self.cfg.max_completion_length, self.stop_ids,
                               self.pad_id, all_done=sync)
                lengths = out.completion_mask.sum(dim=1).tolist()
                ids = out.completion_ids.tolist()
                completions += [row[:n] for row, n in zip(ids, lengths, strict=True)]
                truncated += out.truncated.tolist()
        finally:
            model.train(was_training)
        return completions, truncated

    def _all_done(self, mine: bool) -> bool:
        done = torch.tensor([0.0 if mine else 1.0], device=self.runtime.device)
        return float(self.runtime.reduce(done, "max")) == 0.0

    def score(self, prompts: Prompts, completion_ids: list[list[int]], when: str) -> tuple[list[str], Any]:
        """The completions' texts and this process's :class:`rewards.Scores` of them (TRL's arguments)."""
        g = self.cfg.num_generations
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        given = [p for p in prompts.prompt for _ in range(g)]
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(given, texts, strict=True)]
        keys = list(dict.fromkeys(k for row in prompts.columns for k in row))
        columns = {k: [row.get(k) for row in prompts.columns for _ in range(g)] for k in keys}
        return texts, score(self.rewards, given, completions, completion_ids, columns, when)

    # -- training: a generation batch, gathered ------------------------------------------------------------

    def rollouts(self, model: nn.Module, prompts: Prompts, step: int, chunk: int,
                 write: Callable[[list[dict]], None]) -> Rollouts:
        """This process's prompts completed (``chunk`` at a time) and scored, every process's gathered, the
        advantages and metrics computed from them (the same on every process); ``write`` gets
        ``completions.jsonl``'s lines."""
        started = time.perf_counter()
        completion_ids, truncated = self.complete(model, prompts, step, chunk)
        generated = time.perf_counter()
        texts, scores = self.score(prompts, completion_ids, f"at step {step}")
        scored = time.perf_counter()
        mine = {"index": prompts.index, "prompt_ids": prompts.prompt_ids, "prompt": prompts.prompt,
                "completion_ids": completion_ids, "texts": texts, "truncated": truncated, "columns": scores.columns,
                "error": scores.error, "seconds": (generated - started, scored - generated)}
        parts = self.runtime.gather_object([mine])
        errors = [part["error"] for part in parts if part["error"]]
        if errors:
            raise InputError(errors[0])
        table = torch.cat([reward_table(part["columns"]) for part in parts])
        if (unscored := unscored_sentence(table, f"at step {step}")) is not None:
            raise InputError(unscored)
        rewards = summed_rewards(table, self.weights)
        scaled = group_advantages(rewards, self.cfg.num_generations, self.cfg.scale_rewards)
        every = {key: [v for part in parts for v in part[key]] for key in
                 ("index", "prompt_ids", "prompt", "completion_ids", "texts", "truncated")}
        metrics = {**reward_metrics(table, self.names, scaled), **length_metrics(every["completion_ids"],
                                                                                 every["truncated"])}
        metrics["time/generation_s"] = sum(part["seconds"][0] for part in parts) / len(parts)
        metrics["time/rewards_s"] = sum(part["seconds"][1] for part in parts) / len(parts)
        batch = Rollouts(step, len(parts), every["index"], every["prompt_ids"], every["completion_ids"],
                         every["truncated"], table, scaled.advantages, rewards, metrics)
        write(self.lines(batch, every["prompt"], every["texts"]))
        return batch

    def lines(self, batch: Rollouts, prompts: list[Any], texts: list[str]) -> list[dict[str, Any]]:
        """``completions.jsonl``'s lines of a generation batch: one per completion."""
        g = batch.num_generations
        table, rewards, advantages = batch.table.tolist(), batch.rewards.tolist(), batch.advantages.tolist()
        return [{"step": batch.step, "prompt_index": batch.prompt_index[r // g], "k": r % g, "prompt": prompts[r // g],
                 "completion": texts[r], "rewards": {n: _number(v) for n, v in zip(self.names, table[r], strict=True)},
                 "reward": _number(rewards[r]), "advantage": advantages[r], "truncated": batch.truncated[r]}
                for r in range(len(texts))]

    # -- evaluation ----------------------------------------------------------------------------------------

    def evaluation_sums(self, model: nn.Module, prompts: Prompts, step_label: str) -> dict[str, torch.Tensor]:
        """Per prompt of this process's evaluation batch: its completions' summed reward and how many have one,
        each function's summed values and count, their summed lengths and count (every process agrees on a
        refusal: one gather per batch)."""
        completion_ids, _ = self.complete(model, prompts, EVALUATION_STEP)
        _, scores = self.score(prompts, completion_ids, step_label)
        errors = [e for e in self.runtime.gather_object([scores.error]) if e]
        if errors:
            raise InputError(errors[0])
        assert scores.columns is not None
        g = self.cfg.num_generations
        table = reward_table(scores.columns).view(-1, g, len(self.names))
        rewards = summed_rewards(table.view(-1, len(self.names)), self.weights).view(-1, g)
        sums = {"reward_sum": rewards.nansum(dim=1), "reward_count": (~rewards.isnan()).sum(dim=1).float(),
                "length_sum": torch.tensor([sum(len(c) for c in completion_ids[p * g:(p + 1) * g])
                                            for p in range(len(prompts.index))], dtype=torch.float32),
                "completions": torch.full((len(prompts.index),), float(g))}
        for i, name in enumerate(self.names):
            sums[f"{name}/sum"] = table[..., i].nansum(dim=1)
            sums[f"{name}/count"] = (~table[..., i].isnan()).sum(dim=1).float()
        return {key: value.to(self.runtime.device) for key, value in sums.items()}


def length_metrics(completion_ids: list[list[int]], truncated: list[bool]) -> dict[str, float]:
    """TRL's completion-length metrics of a generation batch (all processes')."""
    lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float32)
    cut = torch.tensor(truncated, dtype=torch.bool)
    ended = lengths[~cut]
    if not len(ended):
        ended = torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": cut.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item()}


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value  # NaN: no opinion
