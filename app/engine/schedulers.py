"""Learning-rate schedules with linear warm-up, as ``LambdaLR`` factories for ``_target_``.

Each is called as ``fn(optimizer, total_steps=N, warmup_steps=..., warmup_ratio=...)`` where N is the
number of optimizer steps of the whole run.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup(total_steps: int, warmup_steps: int, warmup_ratio: float) -> int:
    return warmup_steps if warmup_steps > 0 else int(total_steps * warmup_ratio)


def linear_with_warmup(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                       warmup_ratio: float = 0.0) -> LambdaLR:
    """Warm up linearly to the base LR, then decay linearly to 0 at ``total_steps``."""
    warm = _warmup(total_steps, warmup_steps, warmup_ratio)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return max(0.0, (total_steps - step) / max(1, total_steps - warm))

    return LambdaLR(optimizer, factor)


def cosine_with_warmup(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                       warmup_ratio: float = 0.0) -> LambdaLR:
    """Warm up linearly, then follow a half cosine down to 0 at ``total_steps``."""
    warm = _warmup(total_steps, warmup_steps, warmup_ratio)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def constant_with_warmup(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                         warmup_ratio: float = 0.0) -> LambdaLR:
    warm = _warmup(total_steps, warmup_steps, warmup_ratio)
    return LambdaLR(optimizer, lambda step: (step + 1) / warm if step < warm else 1.0)
