"""Early stopping on scripted metric sequences."""

from __future__ import annotations

import math

import pytest

from app.engine.triggers import EarlyStopping


def first_stop(stopper: EarlyStopping, values: list[float]) -> int | None:
    for i, v in enumerate(values, start=1):
        if stopper.update({"eval/accuracy": v}, step=10 * i):
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


@pytest.mark.parametrize("mode, min_delta, values, best, best_step", [
    ("max", 0.0, [0.5, 0.8, 0.8, 0.7], 0.8, 20),          # a tie is not a new best: the first reaching it is
    ("min", 0.0, [3.0, 2.0, 2.0, 2.0], 2.0, 20),
    ("max", 0.05, [0.5, 0.54, 0.545, 0.5], 0.545, 30),    # within min_delta: no reset of patience, still the best
    ("max", 0.0, [math.nan, 0.3, math.nan], 0.3, 20),
])
def test_the_best_is_the_first_evaluation_that_reached_it(mode, min_delta, values, best, best_step):
    stopper = EarlyStopping("eval/accuracy", mode, None, min_delta)
    first_stop(stopper, values)
    assert (stopper.best, stopper.best_step) == (best, best_step)
    assert stopper.best_metrics == {"eval/accuracy": best}


def test_small_gains_add_up_to_an_improvement_against_the_last_one_that_counted():
    # 0.5 counts; 0.53 and 0.56 are each within 0.05 of the one before, but 0.56 is 0.06 over 0.5.
    stopper = EarlyStopping("eval/accuracy", "max", 2, 0.05)
    assert first_stop(stopper, [0.5, 0.53, 0.56, 0.57, 0.58]) == 5
    assert (stopper.reference, stopper.best, stopper.best_step) == (0.56, 0.58, 50)


def test_state_round_trips():
    a = EarlyStopping("eval/accuracy", "max", 3)
    first_stop(a, [0.5, 0.4])
    b = EarlyStopping("eval/accuracy", "max", 3)
    b.load_state_dict(a.state_dict())
    assert (b.best, b.best_step, b.best_metrics, b.reference, b.bad_evaluations) == (0.5, 10, {"eval/accuracy": 0.5},
                                                                                     0.5, 1)
    old = EarlyStopping("eval/accuracy", "max", 3)  # a checkpoint from before best_step was recorded
    old.load_state_dict({"best": 0.5, "bad_evaluations": 1})
    assert (old.best, old.best_step, old.reference) == (0.5, None, 0.5)


def test_unknown_monitor_names_the_available_metrics():
    with pytest.raises(KeyError, match="eval/f1"):
        EarlyStopping("eval/f1", "max", 1).update({"eval/accuracy": 1.0})
