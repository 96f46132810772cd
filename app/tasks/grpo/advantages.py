"""From the reward functions' values to each completion's advantage, and TRL's reward metrics. Pure
functions of tensors (float32, as TRL 1.16 computes them: ``GRPOTrainer._generate_and_score_completions``
with ``multi_objective_aggregation="sum_then_normalize"``, its default).

The input is the table of one generation batch: a row per completion, the ``G`` completions of a prompt
in consecutive rows, a column per reward function, NaN where the function returned None ("no opinion").
The reward is the weighted sum of a row's numbers (its NaNs left out); a row of NaNs only is
*unscored*: it stays out of its group's baseline and of the statistics, and its advantage is 0.

Every process must compute the advantages from the same table in the same order (all processes' rows,
by the prompt's global index) for ``scale_rewards=batch`` to be the same whatever the number of
processes: the sums below are then taken over the same numbers in the same order.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from app.tasks.grpo.config import ScaleRewards

STD_EPSILON = 1e-4
"""Added to the standard deviation before dividing by it (TRL's constant): a group whose rewards are
all equal gets advantages 0, not NaN."""


class RewardError(ValueError):
    """A reward function's output that cannot be used; the message is one sentence (the caller adds the step)."""


def reward_column(name: str, values: Any, expected: int) -> list[float]:
    """A reward function's output checked: a list (or tuple) of exactly ``expected`` numbers or None (never
    one value broadcast), each finite; None becomes NaN. ``name`` begins the refusal's sentence (the
    function, and where it was called)."""
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{name} returned {type(values).__name__}, not a list of {expected} numbers "
                          "(one per completion, None for no opinion).")
    if len(values) != expected:
        raise RewardError(f"{name} returned {len(values)} value{'' if len(values) == 1 else 's'} for {expected} "
                          "completions (one per completion, None for no opinion).")
    column = []
    for i, value in enumerate(values):
        if value is None:
            column.append(math.nan)
            continue
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(f"{name} returned {value!r} for completion {i}, which is neither a finite "
                              "number nor None.")
        column.append(float(value))
    return column


def reward_table(columns: Sequence[Sequence[float]], device: torch.device | None = None) -> torch.Tensor:
    """``(completions, functions)`` float32 from one column per function (NaN: no opinion)."""
    return torch.tensor(list(zip(*columns, strict=True)), dtype=torch.float32, device=device).view(-1, len(columns))


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation over the numbers that are not NaN, with Bessel's correction; NaN where fewer
    than two numbers."""
    if dim is None:
        values, dim = values.flatten(), 0
    mean = values.nanmean(dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim)
    variance = ((values - mean) ** 2).nanmean(dim=dim) * (count / (count - 1))
    return torch.where(count > 1, variance, torch.nan).sqrt()


def summed_rewards(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted sum of its functions' numbers; NaN where it has none."""
    rewards = (table * weights.to(table)).nansum(dim=1)
    return rewards.masked_fill(table.isnan().all(dim=1), torch.nan)


class Advantages(NamedTuple):
    rewards: torch.Tensor
    """Each completion's reward (NaN: unscored)."""
    advantages: torch.Tensor
    """``(r - mean_group(r)) / (std + 1e-4)`` (``none``: not divided); 0 where the reward is NaN."""
    std: torch.Tensor
    """The standard deviation each advantage was (or, with ``none``, would have been: its group's) scaled by."""

    @property
    def zero_std(self) -> torch.Tensor:
        """Per completion, whether its scale is 0 (TRL's ``frac_reward_zero_std`` is the mean of this)."""
        return torch.isclose(self.std, torch.zeros_like(self.std))


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: ScaleRewards) -> Advantages:
    """Group-relative advantages of a batch of rewards, ``num_generations`` consecutive ones per prompt."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {num_generations}")
    groups = rewards.view(-1, num_generations)
    baseline = groups.nanmean(dim=1).repeat_interleave(num_generations)
    if scale is ScaleRewards.batch:
        std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # group; none: the group's, for frac_reward_zero_std only
        std = nan_std(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - baseline
    if scale is not ScaleRewards.none:
        advantages = advantages / (std + STD_EPSILON)
    return Advantages(rewards, advantages.nan_to_num(nan=0.0), std)


def reward_metrics(table: torch.Tensor, names: Sequence[str], scored: Advantages) -> dict[str, float]:
    """TRL's reward metrics of a generation batch (keys without the ``train/`` or ``eval/`` prefix):
    ``rewards/<name>/mean|std`` over each function's numbers, ``reward`` and ``reward_std`` over the
    scored completions, ``frac_reward_zero_std`` over all completions."""
    stats = torch.stack([*table.nanmean(dim=0), *nan_std(table, dim=0), scored.rewards.nanmean(),
                         nan_std(scored.rewards), scored.zero_std.float().mean()]).tolist()  # one host read
    count = len(names)
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = stats[i]
        metrics[f"rewards/{name}/std"] = stats[count + i]
    metrics["reward"], metrics["reward_std"], metrics["frac_reward_zero_std"] = stats[2 * count:]
    return metrics
