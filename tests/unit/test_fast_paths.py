"""The controller's per-window fast paths give exactly what their general paths give.

Planning and ElChe take C-level shortcuts in the usual case (every rank alive and measured,
one range left in the epoch, gamma = 1); each is checked here against the general code on
random inputs, so a shortcut can only ever be faster, never different.
"""

from __future__ import annotations

import math
import random

import pytest

from flodl.config import ElCheConfig
from flodl.elche import ElChe, averaging_weights, buffer_weights
from flodl.elche.speed import (
    SpeedTracker,
    apply_dead_zone,
    clamp_window,
    elect_anchor_rank,
    speed_counts,
    speed_order,
)
from flodl.runtime.controller.dispatch import EpochCursor

RNG = random.Random(1234)
CASES = 200  # random cases per test


def _general_take(cursor: EpochCursor, counts: list[int], sizes: list[int]) -> list:
    return [cursor._take_batches(c, s) for c, s in zip(counts, sizes, strict=True)]


def test_one_range_take_equals_the_general_take() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 9)
        n = RNG.randint(0, 2000)
        offset = RNG.randint(0, 50)
        counts = [RNG.choice([0, 0, 1, 2, 5, 40]) for _ in range(world)]
        sizes = [RNG.choice([1, 3, 16, 64]) for _ in range(world)]
        fast = EpochCursor(0, n + offset, 16, ranges=[(offset, n)] if n else [])
        slow = EpochCursor(0, n + offset, 16, ranges=[(offset, n)] if n else [])
        assert fast.take(counts, sizes) == _general_take(slow, counts, sizes)
        assert fast.ranges == slow.ranges


def test_speed_order_shortcut_equals_the_general_order() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 12)
        smoothed = [RNG.choice([1.0, 2.0, RNG.uniform(0.5, 3.0)]) for _ in range(world)]
        expected = [r for _, r in sorted((ms, r) for r, ms in enumerate(smoothed))]
        assert speed_order(smoothed, [True] * world) == expected


def test_speed_counts_shortcut_equals_the_formula() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 12)
        smoothed = [RNG.uniform(0.01, 200.0) for _ in range(world)]
        anchor, rank = RNG.randint(1, 50), RNG.randrange(world)
        slow = smoothed[rank]
        expected = [max(1, round(anchor * min(slow / ms, 64.0))) for ms in smoothed]
        assert speed_counts(anchor, smoothed, rank, [7] * world) == expected
        with_gap = [*smoothed[:-1], None]  # an unmeasured rank keeps its fallback (general path)
        if rank != world - 1:
            assert speed_counts(anchor, with_gap, rank, [7] * world) == [*expected[:-1], 7]


def test_clamp_window_shortcut_equals_the_per_rank_copy() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 12)
        counts = [RNG.randint(1, 30) for _ in range(world)]
        order = RNG.sample(range(world), world)
        total = sum(counts)
        out = clamp_window(counts, total + RNG.randint(0, 5), order)
        assert out == counts and out is not counts
        short = clamp_window(counts, max(world, total - 3), order)
        assert sum(short) == min(total, max(world, total - 3)) and all(s >= 1 for s in short)


def test_weights_shortcuts_equal_the_formulas() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 12)
        batches = [RNG.choice([0, 1, 5, 64, 1000]) for _ in range(world)]
        if not any(batches):
            batches[0] = 3
        for gamma in (1.0, 0.5, 0.0, -1.0):
            raw = [float(b) ** gamma if b > 0 else 0.0 for b in batches]
            assert averaging_weights(batches, gamma) == [w / math.fsum(raw) for w in raw]
        stepped = sum(1 for b in batches if b > 0)
        assert buffer_weights(batches) == [1.0 / stepped if b > 0 else 0.0 for b in batches]


@pytest.mark.parametrize("bad", [[True, 1], [1.5, 2], [-1, 2], ["3", 1]])
def test_weights_still_refuse_what_is_not_a_count(bad: list) -> None:
    with pytest.raises(ValueError, match="every entry must be an integer"):
        averaging_weights(bad, 1.0)
    with pytest.raises(ValueError, match="every entry must be an integer"):
        buffer_weights(bad)


def test_report_validation_passes_huge_finite_times_and_refuses_bad_ones() -> None:
    elche = ElChe(ElCheConfig(), 2)
    elche.report([1e308, 1e308], [1, 1], 0.0)  # the sum overflows; every entry is finite
    for bad in ([math.nan, 1.0], [math.inf, 1.0], [1.0, -0.5], [-math.inf, math.inf]):
        with pytest.raises(ValueError, match="compute_ms"):
            elche.report(bad, [1, 1], 0.0)
    with pytest.raises(ValueError, match="batches"):
        elche.report([1.0, 1.0], [1, -1], 0.0)


def test_speed_tracker_shortcuts_equal_the_per_rank_updates() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 9)
        fast, slow = SpeedTracker(world), SpeedTracker(world)
        for _ in range(RNG.randint(1, 12)):
            ms = [RNG.uniform(0.1, 50.0) for _ in range(world)]
            stepped = [RNG.randint(1, 9) for _ in range(world)]  # every rank: the shortcut
            assert fast.update(ms, stepped)
            for r in range(world):  # the general path: a report with this rank alone stepping
                alone = [0] * world
                alone[r] = stepped[r]
                streaks = slow.zero_streaks()
                slow.update(ms, alone)
                slow._zero_streaks = [0 if q == r else streaks[q] for q in range(world)]
            assert fast.windows() == slow.windows() and fast.zero_streaks() == [0] * world
            expected = [math.fsum(w) / len(w) for w in slow.windows()]
            assert fast.smoothed() == expected


def test_elect_anchor_rank_shortcut_equals_the_general_election() -> None:
    for _ in range(CASES):
        world = RNG.randint(1, 12)
        smoothed = [RNG.choice([10.0, 11.0, RNG.uniform(1.0, 12.0)]) for _ in range(world)]
        current = RNG.choice([None, *range(world)])
        # The general path runs when some rank is unmeasured: an extra, unmeasured rank
        # changes nothing about the election among the measured ones.
        general = elect_anchor_rank([*smoothed, None], current)
        assert elect_anchor_rank(smoothed, current) == general


def test_dead_zone_shortcut_keeps_settled_counts() -> None:
    for _ in range(CASES):
        previous = [RNG.randint(1, 60) for _ in range(RNG.randint(1, 12))]
        target = [max(1, p + RNG.choice([0, 0, 1, -1, 5])) for p in previous]
        expected = [
            t if abs(t - p) > 0.05 * p else p for t, p in zip(target, previous, strict=True)
        ]
        assert apply_dead_zone(target, previous) == expected
        assert apply_dead_zone(previous, previous) == previous
