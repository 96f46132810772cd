"""A run whose loss or weights stopped being finite: no checkpoint or export of such weights.

Checkpoints are skipped once the weights are not finite (so the newest checkpoint is the last
finite one), and a run that ends so exports nothing and records the status "nan" (``app.engine.run``).
"""

from __future__ import annotations

import torch

from app.engine.loop import Components


def weights_are_finite(c: Components) -> bool:
    """Whether every process's weights (its shard, when sharded) are all finite. A collective."""
    acc = c.accelerator
    bad = torch.zeros((), device=acc.device)
    for p in c.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a sharded parameter: this process's part
        bad += has_non_finite(local.detach())
    return float(acc.reduce(bad, reduction="sum").item()) == 0.0


def has_non_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``t``'s device: whether ``t`` holds a NaN or an infinity.

    Read from ``t``'s extremes, with no temporary of ``t``'s size: ``torch.isfinite`` on a float tensor
    builds ``t.abs()`` and three bool tensors as large as ``t`` (for MiniLM's word embeddings, 47 MB
    and 3 x 12 MB), which at the end of a run and at every checkpoint set the process's peak memory.
    A NaN propagates through ``amin``/``amax``; an infinity is one of them."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    if not t.is_floating_point():
        return (~torch.isfinite(t)).any()  # integers are finite; complex numbers are rare and small
    return ~torch.isfinite(torch.stack((t.amin(), t.amax()))).all()
