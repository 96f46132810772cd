"""The KTO losses as a table of pure functions (``OBJECTIVES``: TRL 1.16's ``KTOTrainer`` loss types) and
TRL's KTO metrics: per answer, to be summed over a logging window or an evaluation set
(:func:`answer_metrics`), then turned into means over the desirable and the undesirable answers
(:func:`metrics_from_sums`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.tasks.kto.config import KTOLoss

METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
"""TRL's KTO metrics (``chosen``: the desirable answers, ``rejected``: the undesirable ones)."""


@dataclass(frozen=True)
class Answers:
    """What a KTO loss reads, one entry per answer."""

    ratios: torch.Tensor
    """``log π/ref`` of each answer's summed answer log-probabilities."""
    desirable: torch.Tensor
    """Bool: the answer is desirable."""
    z: torch.Tensor
    """The KL estimate (0-d, detached, at least 0): the optimizer step's, or the evaluation batch's."""
    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def kto(a: Answers) -> torch.Tensor:
    """λ_D·(1 - σ(β·(r - z))) for a desirable answer, λ_U·(1 - σ(β·(z - r))) for an undesirable one."""
    good = a.desirable_weight * (1 - torch.sigmoid(a.beta * (a.ratios - a.z)))
    bad = a.undesirable_weight * (1 - torch.sigmoid(a.beta * (a.z - a.ratios)))
    return torch.where(a.desirable, good, bad)


def apo_zero_unpaired(a: Answers) -> torch.Tensor:
    """λ_D·(1 - σ(β·r)) and λ_U·σ(β·r): APO-zero without pairs, no KL estimate."""
    good = a.desirable_weight * (1 - torch.sigmoid(a.beta * a.ratios))
    bad = a.undesirable_weight * torch.sigmoid(a.beta * a.ratios)
    return torch.where(a.desirable, good, bad)


OBJECTIVES: dict[KTOLoss, Callable[[Answers], torch.Tensor]] = {
    KTOLoss.kto: kto,
    KTOLoss.apo_zero_unpaired: apo_zero_unpaired,
}
USES_KL = frozenset({KTOLoss.kto})
"""The losses that read the KL estimate z (the others never compute it)."""


def answer_metrics(a: Answers, logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per answer, what TRL's metrics sum: the rewards ``β·r`` and log-probabilities of the desirable
    answers (0 for the others) and of the undesirable ones, how many of each (1 or 0), and z."""
    rewards = a.beta * a.ratios.detach()
    good = a.desirable.float()
    bad = 1 - good
    return {"rewards/chosen": rewards * good, "rewards/rejected": rewards * bad, "logps/chosen": logps.detach() * good,
            "logps/rejected": logps.detach() * bad, "desirable": good, "undesirable": bad,
            "kl": a.z.detach().float().expand_as(good)}


def metrics_from_sums(sums: dict[str, float], answers: float) -> dict[str, float]:
    """TRL's metrics from sums of :func:`answer_metrics` over ``answers`` answers: the rewards and
    log-probabilities averaged over the desirable answers and over the undesirable ones (left out where
    there are none), the margin between the two reward means, z averaged over the answers."""
    metrics = {"kl": sums["kl"] / max(answers, 1.0)}
    for side, count in (("chosen", sums["desirable"]), ("rejected", sums["undesirable"])):
        if count:
            metrics[f"rewards/{side}"] = sums[f"rewards/{side}"] / count
            metrics[f"logps/{side}"] = sums[f"logps/{side}"] / count
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
