"""The reward model's loss and TRL's metrics, per pair, from the two scores of each pair. Pure functions
of tensors: the tests compute them by hand."""

from __future__ import annotations

import torch
from torch.nn import functional as F

METRICS = ("accuracy", "margin", "mean_reward")
"""TRL's training metrics that are means over the pairs (``min_reward`` and ``max_reward`` are not)."""


def reward_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                  center: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair: ``-log σ(r_c − r_r − margin) + c · (r_c + r_r)²`` (the Bradley-Terry loss, Llama 2's margin,
    the centring term of Eisenstein et al.: its mean over the pairs is TRL's ``c · mean((r_c + r_r)²)``), and
    TRL's metrics: whether the chosen answer scores higher (``accuracy``), by how much (``margin``), and the
    pair's mean score (``mean_reward``; over the pairs, the mean of every score)."""
    difference = chosen - rejected
    losses = -F.logsigmoid(difference if margin is None else difference - margin)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    with torch.no_grad():
        metrics = {"accuracy": (chosen > rejected).float(), "margin": difference.detach(),
                   "mean_reward": (chosen + rejected).detach() / 2}
    return losses, metrics
