"""Early stopping on scripted metric sequences."""

from __future__ import annotations

import math

import pytest

from app.engine.triggers import EarlyStopping


def first_stop(stopper: EarlyStopping, values: list[float]) -> int | None:
    for i, v in enumerate(values, start=1):
        if stopper.update({"eval/accuracy": v}):
            return i
    return None


@pytest.mark.parametrize("mode, patience, min_delta, values, expected", [
    ("max", 2, 0.0, [0.5, 0.6, 0.6, 0.59, 0.7], 4),          # no strict improvement twice
    ("max", 2, 0.05, [0.5, 0.54, 0.545, 0.62], 3),  # 0.54, 0.545 are within min_delta of 0.5
    ("max", 3, 0.0, [0.1, 0.2, 0.3, 0.4], None),               # always improving
    ("min", 1, 0.0, [3.0, 2.0, 2.5], 3),
    ("max", 2, 0.0, [0.5, math.nan, math.nan], 3),             # NaN never counts as an improvement
    ("max", None, 0.0, [0.9, 0.1, 0.1, 0.1], None),            # patience null disables stopping
])
def test_stops_at_the_expected_evaluation(mode, patience, min_delta, values, expected):
    assert first_stop(EarlyStopping("eval/accuracy", mode, patience, min_delta), values) == expected


def test_state_round_trips():
    a = EarlyStopping("eval/accuracy", "max", 3)
    first_stop(a, [0.5, 0.4])
    b = EarlyStopping("eval/accuracy", "max", 3)
    b.load_state_dict(a.state_dict())
    assert (b.best, b.bad_evaluations) == (0.5, 1)


def test_unknown_monitor_names_the_available_metrics():
    with pytest.raises(KeyError, match="eval/f1"):
        EarlyStopping("eval/f1", "max", 1).update({"eval/accuracy": 1.0})
