"""Generated tabular data: Gaussian clusters, one per class, in ``features`` dimensions."""

from __future__ import annotations

import numpy as np


def make_clusters(samples: int, features: int, classes: int, separation: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(float32 features, int64 classes), the same for a seed on every process and every resume."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, features))
    centres *= separation / np.linalg.norm(centres, axis=1, keepdims=True)
    y = np.arange(samples) % classes
    rng.shuffle(y)
    x = centres[y] + rng.normal(size=(samples, features))
    return x.astype(np.float32), y.astype(np.int64)


def split(samples: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, evaluation rows)."""
    order = np.random.default_rng(seed + 1).permutation(samples)
    cut = round(eval_fraction * samples)
    return order[cut:], order[:cut]
