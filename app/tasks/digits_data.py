"""scikit-learn's bundled 8x8 digits and its stratified train/eval split, without importing scikit-learn.

Importing anything from scikit-learn costs about 1.2 s (it pulls scipy and pandas): most of what a
1-step run spent beyond torch. The data is the CSV that ships inside the scikit-learn package, read
with numpy as ``sklearn.datasets.load_digits`` reads it, and the split is the algorithm of
``train_test_split(x, y, test_size=f, random_state=seed, stratify=y)`` (``StratifiedShuffleSplit`` on
a legacy ``RandomState``), so a seed selects the same samples as before; tests/test_digits_data.py
checks both against scikit-learn itself.
"""

from __future__ import annotations

import gzip
import importlib.util
from math import ceil
from pathlib import Path

import numpy as np


def digits_csv() -> Path | None:
    """The CSV inside the installed scikit-learn (found without running the package's ``__init__``)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(1797 x 64 pixel values 0..16 as float64, labels 0..9), as ``load_digits()`` gives them."""
    path = digits_csv()
    if path is None:  # a scikit-learn that keeps its data elsewhere: ask it (slower)
        from sklearn.datasets import load_digits as sklearn_load_digits

        digits = sklearn_load_digits()
        return digits.data, digits.target
    with gzip.open(path, "rt", encoding="utf-8") as file:
        data = np.loadtxt(file, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


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
