"""scikit-learn's bundled 8x8 digits and its stratified train/eval split, without importing scikit-learn.

Importing anything from scikit-learn costs about 1.2 s (it pulls scipy and pandas): most of what a
1-step run spent beyond torch. The data is the CSV that ships inside the scikit-learn package, read
with numpy as ``sklearn.datasets.load_digits`` reads it, and the split (``app.tasks.splits``, shared
with text classification) is scikit-learn's algorithm, so a seed selects the same samples as before; tests/test_digits_data.py
checks both against scikit-learn itself.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["digits_csv", "load_digits"]


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
