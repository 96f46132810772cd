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
        bad += (~torch.isfinite(local.detach())).sum()
    return float(acc.reduce(bad, reduction="sum").item()) == 0.0
