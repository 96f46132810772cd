"""Per-sequence log-probabilities from a forward pass, what the preference objectives read: each
sequence's summed answer log-probability and answer length, and on request its LD-DPO weighting, WPO's
aligned mean and the whole sequence's NLL (ORPO's, the prompt included).

A batch's sequences are its rows (chosen rows, then rejected rows), or, packed, its ``segment`` numbers
(0..count-1, the padding numbered ``count``). Every token's value is added to the sequence its target
belongs to (``index_add``): the same code sums rows and packed sequences. Float32, pure functions of
tensors: the tests compute them by hand."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from app.tasks.causal_lm.batches import IGNORE_INDEX


@dataclass
class Sequences:
    """One entry per sequence (the batch's chosen sides, then its rejected sides)."""

    logps: torch.Tensor
    """Summed answer log-probabilities; with LD-DPO's α, the tokens past the pair's shorter answer weighted α."""
    lengths: torch.Tensor
    """Answer tokens (int64)."""
    plain: torch.Tensor
    """Summed answer log-probabilities, unweighted (what an NLL term reads)."""
    aligned: torch.Tensor | None = None
    """WPO: the mean over answer tokens of ``log p - log Σ_v p_v²`` (detached); None unless asked."""
    whole: torch.Tensor | None = None
    """Summed log-probabilities of every token after the first, the prompt's included; None unless asked."""
    whole_lengths: torch.Tensor | None = None


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its learnt tokens (labels other than -100, each predicted
    by the position before it), in float32, and how many tokens that is."""
    found = sequence_logps(logits, labels)
    return found.logps, found.lengths


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, segment: torch.Tensor | None = None,
                   count: int | None = None, *, ld_alpha: float | None = None, weighting: bool = False,
                   input_ids: torch.Tensor | None = None, real: torch.Tensor | None = None) -> Sequences:
    """Per sequence: see :class:`Sequences`. ``segment``/``count``: a packed batch's sequences; else each
    row is one. ``ld_alpha``: LD-DPO's weighting (the pairs are sequences ``j`` and ``j + count/2``).
    ``weighting``: WPO's aligned means. ``input_ids`` (with ``real``, the rows' non-padding tokens of an
    unpacked batch): the whole sequences' log-probabilities too."""
    rows, width = labels.shape
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1
    learnt = targets != IGNORE_INDEX
    if segment is None:
        count = rows
        owner = torch.arange(rows, device=labels.device)[:, None].expand(rows, width)
    else:
        assert count is not None
        owner = F.pad(segment[:, 1:], (0, 1), value=count)  # target t + 1's sequence
    scored = targets
    whole_mask = None
    if input_ids is not None:
        following = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
        if segment is None:
            present = real if real is not None else torch.ones_like(input_ids, dtype=torch.bool)
            whole_mask = F.pad(present[:, 1:].bool(), (0, 1), value=False)
        else:
            whole_mask = (owner == segment) & (owner < count)  # the next token, of the same sequence
        scored = torch.where(whole_mask, following, IGNORE_INDEX)
    token_logps = -F.cross_entropy(logits.flatten(0, 1).float(), scored.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none").view(rows, width)

    def summed(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        index = torch.where(mask, owner, count).flatten()
        totals = torch.zeros(count + 1, dtype=values.dtype, device=values.device)
        return totals.index_add_(0, index, torch.where(mask, values, 0).flatten())[:count]

    plain = summed(token_logps, learnt)
    lengths = summed(learnt.long(), learnt)
    found = Sequences(logps=plain, lengths=lengths, plain=plain)
    if ld_alpha is not None:
        found.logps = summed(token_logps * ld_weights(learnt, owner, lengths, count, ld_alpha), learnt)
    if weighting:
        with torch.no_grad():
            floats = logits.float()
            log_sum_sq = torch.logsumexp(2 * floats, dim=-1) - 2 * torch.logsumexp(floats, dim=-1)
            found.aligned = summed(token_logps.detach() - log_sum_sq, learnt) / lengths.clamp(min=1)
    if whole_mask is not None:
        found.whole = summed(token_logps, whole_mask)
        found.whole_lengths = summed(whole_mask.long(), whole_mask)
    return found


def ld_weights(learnt: torch.Tensor, owner: torch.Tensor, lengths: torch.Tensor, count: int,
               alpha: float) -> torch.Tensor:
    """LD-DPO: 1 for a sequence's first ``min(its length, its pair's other side's)`` answer tokens, α for
    the rest. A token's rank among its sequence's answer tokens is the running count of answer tokens
    minus the count before the sequence's first one (a sequence's tokens are contiguous in the batch)."""
    flat, seq = learnt.flatten().long(), owner.flatten()
    running = flat.cumsum(0)
    before = torch.full((count + 1,), torch.iinfo(running.dtype).max, device=flat.device, dtype=running.dtype)
    before = before.scatter_reduce(0, torch.where(flat.bool(), seq, count), running - flat, reduce="amin")
    rank = (running - before[seq]).view_as(learnt)
    pairs = count // 2
    shared = torch.minimum(lengths[:pairs], lengths[pairs:]).repeat(2)
    shared = F.pad(shared, (0, 1), value=0)  # the padding's bin
    return torch.where(rank <= shared[owner], 1.0, alpha)
