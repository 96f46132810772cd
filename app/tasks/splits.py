"""A stratified train/held-out split without importing scikit-learn: the algorithm of
``train_test_split(x, y, test_size=f, random_state=seed, stratify=y)`` (``StratifiedShuffleSplit`` on a
legacy ``RandomState``), so a seed selects the same samples as scikit-learn would (tests/test_digits_data.py
checks it). Importing anything from scikit-learn costs about 1.2 s (it pulls scipy and pandas).

Used by digits and by text_classification when no validation split is given.
"""

from __future__ import annotations

from math import ceil

import numpy as np


def approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``n_draws`` each class gets: the floor of its share, then the left-over draws to
    the largest remainders, ties broken at random (``sklearn.utils.extmath._approximate_mode``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (candidates,) = np.where(remainder == value)
            add_now = min(len(candidates), need_to_add)
            floored[rng.choice(candidates, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): each class in both in proportion, shuffled by ``seed``."""
    n_test = ceil(test_fraction * len(y))
    n_train = len(y) - n_test
    _, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = approximate_mode(class_counts, n_train, rng)
    t_i = approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i, count in enumerate(class_counts):
        shuffled = class_indices[i].take(rng.permutation(count), mode="clip")
        train.extend(shuffled[: n_i[i]])
        test.extend(shuffled[n_i[i]: n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)
