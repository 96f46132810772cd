"""Seeding and RNG state capture for every generator a training run touches."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device). ``device_specific`` adds the process
    index (a different stream per process); ``deterministic`` asks torch for deterministic kernels."""
    if device_specific:
        from app.distributed.state import live_backend

        seed += live_backend().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices
    if deterministic:
        torch.use_deterministic_algorithms(True)
