"""The preference objectives of ``task=dpo`` as one table of pure functions (``OBJECTIVES``): each takes
a pair's :class:`Terms` and gives each pair's loss. TRL 1.16's formulas (``DPOTrainer``'s loss types,
``CPOTrainer``'s ``simpo`` and ``sigmoid`` as ``cpo``, ``ORPOTrainer``'s odds ratio); a list of them is
summed with its weights (:func:`preference_losses`), each weighted by WPO's pair weights when given.

Which objectives need no reference, which ``task.label_smoothing`` changes and which compare the pairs of
a micro-batch with each other live beside the names, in ``config.py`` (torch-free); a test keeps the table
and the names in step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from app.tasks.dpo.config import REFERENCE_FREE, LossType

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")
"""TRL's metrics of every objective (reference-free ones: rewards of the policy alone)."""


@dataclass(frozen=True)
class Terms:
    """What an objective reads. ``(2, pairs)`` tensors hold the chosen sides in row 0, the rejected in row 1."""

    policy: torch.Tensor
    """Summed answer log-probabilities of the policy (LD-DPO-weighted where asked)."""
    reference: torch.Tensor
    """The reference's; zeros for a reference-free objective."""
    lengths: torch.Tensor
    """Answer tokens."""
    nll: torch.Tensor
    """``(pairs,)``: the chosen side's NLL scaled so that its mean over the optimizer step's pairs is the
    mean over the step's NLL tokens (``sft``, ``cpo``'s and ``simpo``'s term: the answer's; ``orpo``'s:
    the whole sequence's); zeros when no objective reads it."""
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    @property
    def ratios(self) -> torch.Tensor:
        """``log π/ref`` of each side (the policy's log-probabilities alone without a reference)."""
        return self.policy - self.reference

    @property
    def margin(self) -> torch.Tensor:
        return self.ratios[0] - self.ratios[1]

    @property
    def averaged(self) -> torch.Tensor:
        """The ratios per answer token."""
        return self.ratios / self.lengths.clamp(min=1)


def smoothed(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``-(1-ε)·log σ(x) - ε·log σ(-x)``: the logistic loss with a share ε of its labels flipped."""
    return -(1 - epsilon) * F.logsigmoid(logits) - epsilon * F.logsigmoid(-logits)


def sigmoid(t: Terms) -> torch.Tensor:
    return smoothed(t.beta * t.margin, t.label_smoothing)


def hinge(t: Terms) -> torch.Tensor:
    return torch.relu(1 - t.beta * t.margin)


def ipo(t: Terms) -> torch.Tensor:
    return (t.averaged[0] - t.averaged[1] - 1 / (2 * t.beta)) ** 2


def exo_pair(t: Terms) -> torch.Tensor:
    """KL(softmax(β·(r_c, r_r)) ‖ (1-ε, ε)) over the pair."""
    z, eps = t.beta * t.margin, t.label_smoothing
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))


def nca_pair(t: Terms) -> torch.Tensor:
    chosen, rejected = t.beta * t.ratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def robust(t: Terms) -> torch.Tensor:
    z, eps = t.beta * t.margin, t.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def bco_pair(t: Terms) -> torch.Tensor:
    chosen, rejected = t.beta * t.ratios
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def sppo_hard(t: Terms) -> torch.Tensor:
    chosen, rejected = t.ratios
    return (chosen - 0.5 / t.beta) ** 2 + (rejected + 0.5 / t.beta) ** 2


def aot(t: Terms) -> torch.Tensor:
    """The batch's policy margins and reference margins, each sorted, compared rank by rank."""
    policy = torch.sort(t.policy[0] - t.policy[1]).values
    reference = torch.sort(t.reference[0] - t.reference[1]).values
    return smoothed(t.beta * (policy - reference), t.label_smoothing)


def aot_unpaired(t: Terms) -> torch.Tensor:
    chosen, rejected = (torch.sort(side).values for side in t.ratios)
    return smoothed(t.beta * (chosen - rejected), t.label_smoothing)


def apo_zero(t: Terms) -> torch.Tensor:
    chosen, rejected = t.beta * t.ratios
    return 1 - torch.sigmoid(chosen) + torch.sigmoid(rejected)


def apo_down(t: Terms) -> torch.Tensor:
    chosen, rejected = t.beta * t.ratios
    return torch.sigmoid(chosen) + 1 - torch.sigmoid(chosen - rejected)


def discopop(t: Terms) -> torch.Tensor:
    logits = t.beta * t.margin
    blend = torch.sigmoid(logits / t.discopop_tau)
    return -F.logsigmoid(logits) * (1 - blend) + torch.exp(-logits) * blend


def sft(t: Terms) -> torch.Tensor:
    return t.nll


def sigmoid_norm(t: Terms) -> torch.Tensor:
    return -F.logsigmoid(t.beta * (t.averaged[0] - t.averaged[1]))


def simpo(t: Terms) -> torch.Tensor:
    """``-log σ(β·(p̄_c - p̄_r) - γ)`` (smoothed by ε), plus ``cpo_alpha`` × NLL."""
    logits = t.averaged[0] - t.averaged[1] - t.simpo_gamma / t.beta
    return smoothed(t.beta * logits, t.label_smoothing) + t.cpo_alpha * t.nll


def cpo(t: Terms) -> torch.Tensor:
    return smoothed(t.beta * t.margin, t.label_smoothing) + t.cpo_alpha * t.nll


def log_odds(t: Terms) -> torch.Tensor:
    """ORPO's ``log odds(y_c) - log odds(y_r)``, ``odds(y) = p̄/(1 - p̄)`` of the per-token averaged probability."""
    chosen, rejected = t.averaged
    return (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(t: Terms) -> torch.Tensor:
    return t.nll - t.beta * F.logsigmoid(log_odds(t))


@dataclass(frozen=True)
class Objective:
    loss: Callable[[Terms], torch.Tensor]
    nll: str | None = None
    """Which NLL the objective reads (:attr:`Terms.nll`): ``answer`` (the chosen answers' tokens) or
    ``whole`` (the chosen sequences' every token after the first, as ``ORPOTrainer``)."""
    averaged: bool = False
    """Reference-free: its rewards and ``logps/*`` are per answer token (as TRL logs them)."""


OBJECTIVES: dict[LossType, Objective] = {
    LossType.sigmoid: Objective(sigmoid),
    LossType.hinge: Objective(hinge),
    LossType.ipo: Objective(ipo),
    LossType.exo_pair: Objective(exo_pair),
    LossType.nca_pair: Objective(nca_pair),
    LossType.robust: Objective(robust),
    LossType.bco_pair: Objective(bco_pair),
    LossType.sppo_hard: Objective(sppo_hard),
    LossType.aot: Objective(aot),
    LossType.aot_unpaired: Objective(aot_unpaired),
    LossType.apo_zero: Objective(apo_zero),
    LossType.apo_down: Objective(apo_down),
    LossType.discopop: Objective(discopop),
    LossType.sft: Objective(sft, nll="answer"),
    LossType.sigmoid_norm: Objective(sigmoid_norm),
    LossType.simpo: Objective(simpo, nll="answer", averaged=True),
    LossType.cpo: Objective(cpo, nll="answer"),
    LossType.orpo: Objective(orpo, nll="whole", averaged=True),
}


def nll_kind(kinds: tuple[LossType, ...], cpo_alpha: float) -> str | None:
    """The NLL the objectives read (``answer``, ``whole``), None when none does (simpo without ``cpo_alpha``)."""
    found = {OBJECTIVES[kind].nll for kind in kinds if kind is not LossType.simpo or cpo_alpha} - {None}
    return next(iter(found), None)


def preference_losses(terms: Terms, kinds: tuple[LossType, ...], weights: tuple[float, ...],
                      pair_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair, the weighted sum of the objectives' losses (each times WPO's ``pair_weights`` when given)
    and TRL's metrics of the first objective's family."""
    losses = torch.zeros_like(terms.policy[0])
    for kind, weight in zip(kinds, weights, strict=True):
        loss = OBJECTIVES[kind].loss(terms)
        losses = losses + weight * (loss * pair_weights if pair_weights is not None else loss)
    return losses, pair_metrics(terms, kinds[0])


def pair_metrics(terms: Terms, kind: LossType) -> dict[str, torch.Tensor]:
    """TRL's metrics per pair: ``rewards/*`` (β × the log-ratios; reference-free: × the policy's
    log-probabilities, per token where the objective averages them), ``logps/*``; CPO, SimPO and ORPO add
    ``nll_loss``, ORPO ``log_odds_ratio`` and ``log_odds_chosen``."""
    objective = OBJECTIVES[kind]
    logps = (terms.averaged if objective.averaged else terms.policy).detach()
    rewards = terms.beta * (logps if kind in REFERENCE_FREE else terms.ratios.detach())
    metrics = {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1], "rewards/margins": rewards[0] - rewards[1],
               "rewards/accuracies": (rewards[0] > rewards[1]).float(), "logps/chosen": logps[0],
               "logps/rejected": logps[1]}
    if kind in REFERENCE_FREE:
        metrics["nll_loss"] = terms.nll.detach()
    if kind is LossType.orpo:
        odds = log_odds(terms).detach()
        metrics["log_odds_ratio"], metrics["log_odds_chosen"] = F.logsigmoid(odds), odds
    return metrics


def metric_names(kind: LossType) -> tuple[str, ...]:
    """The metrics :func:`pair_metrics` gives for objectives led by ``kind``."""
    extra = ("nll_loss",) if kind in REFERENCE_FREE else ()
    return DPO_METRICS + extra + (("log_odds_ratio", "log_odds_chosen") if kind is LossType.orpo else ())
