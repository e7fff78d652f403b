"""Dispatch on fake ranks: chunks are consecutive, proportional, and cover each epoch once."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from flodl.runtime.controller.dispatch import (
    Coverage,
    EpochCursor,
    count_batches,
    proportional_counts,
)


def test_cursor_hands_out_consecutive_chunks():
    cursor = EpochCursor(epoch=0, n_samples=100, batch_size=10)
    assert cursor.take([2, 1]) == [((0, 20),), ((20, 10),)]
    assert cursor.remaining_batches == 7
    assert cursor.take([5, 5]) == [((30, 50),), ((80, 20),)]
    assert cursor.done
    assert cursor.take([1, 1]) == [(), ()]


def test_last_chunk_may_be_partial():
    cursor = EpochCursor(epoch=0, n_samples=25, batch_size=10)
    chunks = cursor.take([2, 1])
    assert chunks == [((0, 20),), ((20, 5),)]
    assert [count_batches(c, 10) for c in chunks] == [2, 1]


def test_coverage_detects_gaps_and_overlaps():
    cov = Coverage(100)
    cov.record(0, [(0, 40), (40, 60)])
    assert cov.exact(0)
    cov.record(1, [(0, 50), (40, 30)])
    assert cov.overlaps(1) == 10
    assert cov.uncovered(1) == [(70, 30)]
    assert not cov.exact(1)
    assert cov.to_dict()["per_epoch"][1]["uncovered"] == [(70, 30)]


@given(
    n=st.integers(1, 5000),
    bs=st.integers(1, 256),
    plans=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=5), min_size=1, max_size=200),
)
def test_any_sequence_of_windows_covers_exactly_once(n, bs, plans):
    cursor = EpochCursor(0, n, bs)
    cov = Coverage(n)
    for counts in plans:
        for chunks in cursor.take(counts):
            cov.record(0, chunks)
    while not cursor.done:
        for chunks in cursor.take([1]):
            cov.record(0, chunks)
    assert cov.exact(0)


@given(
    ratios=st.lists(st.floats(0.05, 10), min_size=1, max_size=8),
    total=st.integers(0, 10_000),
)
def test_proportional_counts_sum_and_floor(ratios, total):
    counts = proportional_counts(ratios, total)
    assert sum(counts) == total
    if total >= len(ratios):
        assert min(counts) >= 1


def test_proportional_counts_follow_ratios():
    assert proportional_counts([1.0, 0.4], 70) == [50, 20]


def test_sharded_cursor_hands_out_whole_shards_in_proportion() -> None:
    from flodl.data.streams import shard_boundaries

    sizes = [40, 25, 30, 50, 15, 40]  # 200 samples in 6 shards
    bounds = shard_boundaries(sizes, seed=1, epoch=2)
    assert sorted(bounds) == bounds and bounds[0] == 0 and len(bounds) == 6
    cursor = EpochCursor(2, 200, 10, boundaries=bounds)
    handed = []
    while not cursor.done:
        handed.extend(cursor.take([4, 2]))  # a 2:1 throughput split, in batches
    edges = set(bounds) | {200}
    for chunks in handed:
        for offset, size in chunks:
            assert offset in edges and offset + size in edges  # whole shards only
    flat = sorted(c for chunks in handed for c in chunks)
    assert sum(n for _, n in flat) == 200
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(flat))  # once each
    lost = handed[0]
    cursor.give_back(list(lost))  # a lost rank's shards go back whole, and out again whole
    again = cursor.take([100, 0])[0]
    assert again == lost
