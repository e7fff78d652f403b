"""Speed tracking, anchor election and the count arithmetic of flodl.elche.speed."""

from __future__ import annotations

import pytest

from flodl.elche.speed import (
    SpeedTracker,
    apply_dead_zone,
    bound_spread,
    clamp_window,
    elect_anchor_rank,
    relative_counts,
    speed_counts,
    speed_order,
)


def test_trust_window_is_mean_of_last_five_samples() -> None:
    tracker = SpeedTracker(2)
    for ms in (100.0, 200.0, 300.0, 400.0, 500.0, 600.0):
        tracker.update([ms * 2, 20.0], [2, 1])
    # 100 fell out of the window: mean of 200..600.
    assert tracker.smoothed() == [400.0, 20.0]
    assert tracker.windows()[0] == [200.0, 300.0, 400.0, 500.0, 600.0]


def test_update_reports_whether_any_rank_was_timed() -> None:
    tracker = SpeedTracker(2)
    assert tracker.update([0.0, 0.0], [0, 0]) is False
    assert tracker.smoothed() == [None, None]
    assert tracker.update([0.0, 30.0], [0, 3]) is True
    assert tracker.smoothed() == [None, 10.0]


def test_five_zero_batch_reports_clear_a_rank() -> None:
    tracker = SpeedTracker(2)
    tracker.update([50.0, 50.0], [5, 5])
    for _ in range(4):
        tracker.update([0.0, 50.0], [0, 5])
    assert tracker.smoothed()[0] == 10.0  # four idle reports: still trusted
    tracker.update([0.0, 50.0], [0, 5])
    assert tracker.smoothed() == [None, 10.0]
    assert tracker.zero_streaks() == [5, 0]


def test_a_timed_report_resets_the_zero_streak() -> None:
    tracker = SpeedTracker(1)
    tracker.update([10.0], [1])
    for _ in range(4):
        tracker.update([0.0], [0])
    tracker.update([10.0], [1])
    for _ in range(4):
        tracker.update([0.0], [0])
    assert tracker.smoothed() == [10.0]


def test_tracker_rejects_windows_of_wrong_world_size() -> None:
    with pytest.raises(ValueError, match="one entry per rank"):
        SpeedTracker(3, windows=[[1.0], [2.0]], zero_streaks=[0, 0])


def test_election_picks_lowest_index_of_the_slow_cohort() -> None:
    # 100 and 110 are within 15% of the slowest: the cohort is {1, 2}; rank 0 is fast.
    assert elect_anchor_rank([50.0, 100.0, 110.0], None) == 1
    assert elect_anchor_rank([50.0, 40.0, 110.0], None) == 2
    assert elect_anchor_rank([None, None], None) is None


def test_election_keeps_the_anchor_unless_a_challenger_is_ten_percent_slower() -> None:
    assert elect_anchor_rank([100.0, 109.0], current=0) == 0
    assert elect_anchor_rank([100.0, 111.0], current=0) == 1
    # Equal speeds never flip the anchor.
    assert elect_anchor_rank([100.0, 100.0], current=1) == 1


def test_election_replaces_an_anchor_without_speed() -> None:
    assert elect_anchor_rank([None, 90.0, 100.0], current=0) == 1
    assert elect_anchor_rank([None, 80.0, 100.0], current=0) == 2


def test_speed_order_fastest_first_with_index_tiebreak() -> None:
    assert speed_order([30.0, 10.0, 10.0, None], [True] * 4) == [1, 2, 0, 3]
    assert speed_order([30.0, 10.0, 10.0], [True, False, True]) == [2, 0]
    assert speed_order([None, None, None], [True] * 3, speed_hint=[0.4, 1.0, 1.0]) == [1, 2, 0]


def test_speed_counts_follow_the_speed_ratio_and_cap_at_64() -> None:
    assert speed_counts(10, [40.0, 100.0], 1, [10, 10]) == [25, 10]
    assert speed_counts(10, [1.0, 1000.0], 1, [10, 10]) == [640, 10]
    assert speed_counts(10, [0.0, 100.0], 1, [10, 10]) == [640, 10]
    # An unmeasured rank keeps its previous count; counts never drop under one.
    assert speed_counts(1, [None, 100.0, 1000.0], 1, [7, 1, 1]) == [7, 1, 1]


def test_relative_counts_give_the_smallest_weight_the_anchor() -> None:
    assert relative_counts(10, [1.0, 0.4], cap=64.0) == [25, 10]
    assert relative_counts(10, [3.0, 1.0, 2.0], cap=None) == [30, 10, 20]
    assert relative_counts(1, [1.0, 1000.0], cap=64.0) == [1, 64]


def test_dead_zone_keeps_counts_on_small_moves() -> None:
    # 25 -> 24 is 4%: kept; 25 -> 23 is 8%: taken.
    assert apply_dead_zone([24, 10], [25, 10]) == [25, 10]
    assert apply_dead_zone([23, 11], [25, 10]) == [23, 11]


def test_bound_spread_clamps_the_fast_ranks() -> None:
    assert bound_spread([100, 10, 30], 5) == [15, 10, 15]
    assert bound_spread([100, 10], 0) == [10, 10]
    assert bound_spread([100, 10], None) == [100, 10]


def test_clamp_window_scales_down_proportionally() -> None:
    out = clamp_window([25, 10], 20, order=[0, 1])
    assert out == [15, 5]
    assert clamp_window([25, 10], 35, order=[0, 1]) == [25, 10]


def test_clamp_window_gives_fastest_first_when_short() -> None:
    assert clamp_window([25, 10, 10], 2, order=[2, 0, 1]) == [1, 0, 1]
    assert clamp_window([25, 10], 0, order=[0, 1]) == [0, 0]
    assert clamp_window([25, 10], 5, order=[]) == [0, 0]
