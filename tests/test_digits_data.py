"""The digits task reads scikit-learn's bundled data and splits it without importing scikit-learn (a
1.2 s import): the same arrays and the same stratified split as scikit-learn's own functions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from app.tasks.digits.data import load_digits
from app.tasks.splits import stratified_split


def test_the_digits_are_scikit_learns():
    from sklearn.datasets import load_digits as sklearn_load_digits

    pixels, labels = load_digits()
    reference = sklearn_load_digits()
    assert pixels.shape == (1797, 64)
    np.testing.assert_array_equal(pixels, reference.data)
    np.testing.assert_array_equal(labels, reference.target)


@pytest.mark.parametrize(("fraction", "seed"), [(0.2, 0), (0.2, 7), (0.1, 123), (0.37, 5), (0.5, 2**31 - 1)])
def test_the_split_is_train_test_splits(fraction, seed):
    from sklearn.model_selection import train_test_split

    _, labels = load_digits()
    indices = np.arange(len(labels))
    expected_train, expected_test = train_test_split(indices, test_size=fraction, random_state=seed,
                                                     stratify=labels)
    train, test = stratified_split(labels, fraction, seed)
    np.testing.assert_array_equal(train, expected_train)
    np.testing.assert_array_equal(test, expected_test)


def test_ties_between_classes_are_broken_like_scikit_learn():
    from sklearn.model_selection import train_test_split

    labels = np.repeat(np.arange(7), [5, 5, 5, 4, 4, 3, 3])  # equal remainders: random tie-breaks
    for seed in range(5):
        expected = train_test_split(np.arange(len(labels)), test_size=0.3, random_state=seed, stratify=labels)
        got = stratified_split(labels, 0.3, seed)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_building_the_digits_data_imports_no_scikit_learn():
    code = ("import sys; from app.tasks.digits.task import DigitsTask; from app.tasks.digits.config import DigitsConfig; "
            "DigitsTask(DigitsConfig()).build_data(None); print(sorted(m for m in sys.modules if m.startswith('sklearn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
