"""The preference losses and TRL's metrics, from the summed answer log-probabilities of the policy and
the reference (one entry per pair). Pure functions of tensors: the test computes them by hand."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from app.tasks.causal_lm.batches import IGNORE_INDEX
from app.tasks.causal_lm.task import token_losses
from app.tasks.dpo.config import LossType


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its learnt tokens (labels other than -100, each predicted
    by the position before it), in float32, and how many tokens that is."""
    losses, targets = token_losses(logits, labels)
    return -losses.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1)


def segment_logps(logits: torch.Tensor, labels: torch.Tensor, segment: torch.Tensor,
                  count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`answer_logps` of packed rows: per sequence (``segment`` numbers each token's sequence,
    ``count`` of them; the padding is numbered ``count``), summed over its learnt tokens."""
    losses, targets = token_losses(logits, labels)
    learnt = targets != IGNORE_INDEX
    owner = torch.where(learnt, F.pad(segment[:, 1:], (0, 1), value=count), count).flatten()  # target t + 1's
    sums = torch.zeros(count + 1, dtype=losses.dtype, device=losses.device).index_add_(0, owner, losses.flatten())
    lengths = torch.zeros(count + 1, dtype=torch.int64, device=losses.device).index_add_(
        0, owner, learnt.flatten().long())
    return -sums[:count], lengths[:count]


def preference_losses(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, beta: float,
                      label_smoothing: float, loss_type: LossType) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair, the loss and TRL's metrics. ``policy``, ``reference``: (2, pairs) summed answer
    log-probabilities, chosen first; ``lengths``: (2, pairs) answer tokens.

    sigmoid: ``-(1-ε)·log σ(β·m) - ε·log σ(-β·m)``, ``m = (π_c - ref_c) - (π_r - ref_r)``;
    ipo: ``(m' - 1/(2β))²``, ``m'`` the same over log-probabilities averaged per answer token."""
    ratios = policy - reference  # (2, pairs): log π/ref of chosen, of rejected
    if loss_type is LossType.sigmoid:
        logits = beta * (ratios[0] - ratios[1])
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    else:
        averaged = ratios / lengths.clamp(min=1)
        losses = (averaged[0] - averaged[1] - 1 / (2 * beta)) ** 2
    rewards = beta * ratios.detach()
    metrics = {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1],
               "rewards/margins": rewards[0] - rewards[1], "rewards/accuracies": (rewards[0] > rewards[1]).float(),
               "logps/chosen": policy[0].detach(), "logps/rejected": policy[1].detach()}
    return losses, metrics
