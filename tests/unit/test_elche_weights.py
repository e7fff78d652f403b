"""Averaging weights, buffer weights and the cpu_async overshoot bound."""

from __future__ import annotations

import pytest

from flodl.elche import (
    MAX_OVERSHOOT_CEILING,
    Verdict,
    auto_max_overshoot,
    averaging_weights,
    buffer_weights,
    step_max_overshoot,
)


def test_gamma_one_weights_by_work() -> None:
    assert averaging_weights([30, 10], 1.0) == pytest.approx([0.75, 0.25])


def test_gamma_zero_is_equal_among_ranks_that_stepped() -> None:
    assert averaging_weights([30, 10, 0], 0.0) == pytest.approx([0.5, 0.5, 0.0])


def test_gamma_minus_one_is_per_step_equal() -> None:
    assert averaging_weights([30, 10], -1.0) == pytest.approx([0.25, 0.75])


def test_zero_step_ranks_are_excluded() -> None:
    weights = averaging_weights([0, 20, 60], 1.0)
    assert weights[0] == 0.0
    assert weights == pytest.approx([0.0, 0.25, 0.75])
    assert sum(weights) == pytest.approx(1.0)


def test_all_zero_batches_is_an_error() -> None:
    with pytest.raises(ValueError, match="no rank stepped"):
        averaging_weights([0, 0], 1.0)
    with pytest.raises(ValueError, match="no rank stepped"):
        buffer_weights([0, 0])


def test_negative_batches_and_bad_gamma_are_errors() -> None:
    with pytest.raises(ValueError, match="integer >= 0"):
        averaging_weights([3, -1], 1.0)
    with pytest.raises(ValueError, match="gamma"):
        averaging_weights([3, 1], float("nan"))


def test_buffer_weights_equal_among_ranks_that_stepped() -> None:
    assert buffer_weights([5, 0, 100, 1]) == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])


@pytest.mark.parametrize(
    ("total", "expected"),
    [(0, (2, 3)), (150, (2, 3)), (300, (3, 6)), (10_000, (5, 10)), (10**9, (5, 10))],
)
def test_auto_max_overshoot(total: int, expected: tuple[int, int]) -> None:
    assert auto_max_overshoot(total) == expected
    assert max(auto_max_overshoot(total)) <= MAX_OVERSHOOT_CEILING


def test_auto_max_overshoot_rejects_negative() -> None:
    with pytest.raises(ValueError, match="total_batches_per_epoch"):
        auto_max_overshoot(-1)


def test_overshoot_grows_on_stable_and_resets_on_nudge() -> None:
    assert step_max_overshoot(2, Verdict.STABLE, initial=2, cap=3) == 3
    assert step_max_overshoot(3, Verdict.STABLE, initial=2, cap=3) == 3
    assert step_max_overshoot(3, Verdict.SUPPRESS_GROWTH, initial=2, cap=3) == 3
    assert step_max_overshoot(3, Verdict.NUDGE_DOWN, initial=2, cap=3) == 2
