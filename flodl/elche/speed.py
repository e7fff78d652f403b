"""Per-rank speed: trust-window smoothing, slow-rank election, and speeds turned into counts.

A rank's speed is its wall milliseconds per batch. Single cycles are noisy (a GC pause, a data
hiccup), so ElChe trusts the mean of the last few samples rather than the latest one, and it
elects the slow rank with hysteresis so that two near-equal devices do not swap the anchor on
every jitter. Batch counts follow from speeds: each rank gets the anchor times how much faster
it is than the anchor rank, so every rank finishes a window at about the same wall time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

#: Samples kept per rank; the smoothed speed is their mean.
TRUST_WINDOW = 5
#: Consecutive reports without a batch after which a rank's samples are considered stale.
ZERO_REPORTS_TO_CLEAR = 5
#: Ranks within this fraction of the slowest one form the slow cohort.
SLOW_COHORT_BAND = 0.15
#: A cohort challenger replaces the current anchor rank only when this much slower.
CHALLENGE_MARGIN = 0.10
#: No rank does more than this many times the anchor rank's batches in one window.
MAX_SPEED_RATIO = 64.0
#: A rank's count only changes when the new target differs by more than this fraction.
DEAD_ZONE = 0.05


class SpeedTracker:
    """Trust windows of ms/batch samples, one per rank."""

    def __init__(
        self,
        world_size: int,
        windows: Sequence[Sequence[float]] | None = None,
        zero_streaks: Sequence[int] | None = None,
    ) -> None:
        self._windows: list[list[float]] = (
            [[float(x) for x in w][-TRUST_WINDOW:] for w in windows]
            if windows is not None
            else [[] for _ in range(world_size)]
        )
        self._zero_streaks = list(zero_streaks) if zero_streaks is not None else [0] * world_size
        self._smoothed: list[float | None] | None = None  # cache of smoothed(), until update()
        if len(self._windows) != world_size or len(self._zero_streaks) != world_size:
            raise ValueError(f"speed windows must have one entry per rank ({world_size})")

    def update(self, compute_ms: Sequence[float], batches: Sequence[int]) -> bool:
        """Add one report; True when at least one rank delivered a timing sample."""
        self._smoothed = None
        if len(compute_ms) != len(self._windows) or len(batches) != len(self._windows):
            raise ValueError(f"update: one entry per rank ({len(self._windows)}) is needed")
        if batches and min(batches) > 0:  # every rank stepped (the usual case): one tight pass
            for window, ms, n in zip(self._windows, compute_ms, batches, strict=True):
                window.append(ms / n)
                if len(window) > TRUST_WINDOW:
                    del window[0]
            self._zero_streaks = [0] * len(batches)
            return True
        timed = False
        for rank, (ms, n) in enumerate(zip(compute_ms, batches, strict=True)):
            if n > 0:
                window = self._windows[rank]
                window.append(ms / n)
                if len(window) > TRUST_WINDOW:
                    del window[0]
                self._zero_streaks[rank] = 0
                timed = True
                continue
            self._zero_streaks[rank] += 1
            if self._zero_streaks[rank] >= ZERO_REPORTS_TO_CLEAR:
                # A rank idle this long (dead, starved, or parked) would otherwise steer the
                # cadence with speeds measured under conditions that no longer hold.
                self._windows[rank].clear()
        return timed

    def smoothed(self) -> list[float | None]:
        """Trust-window mean ms/batch per rank (None while a rank has no sample); a fresh list
        each call (ElChe asks several times per report: the means are computed once)."""
        return list(self.means())

    def means(self) -> list[float | None]:
        """:meth:`smoothed` without the copy, for readers that do not keep or change it."""
        if self._smoothed is None:
            windows = self._windows
            if all(windows):  # every rank measured: the sums and lengths at C speed
                sums, lens = map(math.fsum, windows), map(len, windows)
                self._smoothed = [s / n for s, n in zip(sums, lens, strict=True)]
            else:
                self._smoothed = [math.fsum(w) / len(w) if w else None for w in windows]
        return self._smoothed

    def windows(self) -> list[list[float]]:
        """A copy of the raw samples, oldest first (for the resumable state)."""
        return [list(w) for w in self._windows]

    def zero_streaks(self) -> list[int]:
        """A copy of the consecutive zero-batch report counts per rank."""
        return list(self._zero_streaks)


def elect_anchor_rank(smoothed: Sequence[float | None], current: int | None) -> int | None:
    """The slow rank that anchors the cadence, or None while no rank has a speed.

    The slow cohort is every rank within :data:`SLOW_COHORT_BAND` of the slowest. Without a
    usable current anchor the lowest index of the cohort wins, so near-equal devices elect the
    same rank on every controller. A current anchor is kept unless the slowest cohort member is
    at least :data:`CHALLENGE_MARGIN` slower than it (hysteresis against jitter).
    """
    if smoothed and None not in smoothed:  # every rank measured: no pairs for the others
        values = cast("Sequence[float]", smoothed)
        bound = (1.0 - SLOW_COHORT_BAND) * max(values)
        cohort = [(ms, rank) for rank, ms in enumerate(values) if ms >= bound]
    else:
        known = [(ms, rank) for rank, ms in enumerate(smoothed) if ms is not None]
        if not known:
            return None
        bound = (1.0 - SLOW_COHORT_BAND) * max(known)[0]
        cohort = [(ms, rank) for ms, rank in known if ms >= bound]
    current_ms = smoothed[current] if current is not None else None
    if current is None or current_ms is None:
        return min(rank for _, rank in cohort)
    challenger_ms, challenger = max(cohort, key=lambda item: (item[0], -item[1]))
    if challenger != current and challenger_ms >= (1.0 + CHALLENGE_MARGIN) * current_ms:
        return challenger
    return current


def speed_order(
    smoothed: Sequence[float | None],
    alive: Sequence[bool],
    speed_hint: Sequence[float] | None = None,
) -> list[int]:
    """Alive ranks, fastest first.

    Measured ranks come first by ascending ms/batch; unmeasured ones follow, ordered by the
    speed hint (highest relative speed first) when there is one, else by index. Ties always go
    to the lowest index, so the order is deterministic.
    """
    if all(alive) and None not in smoothed:
        # The usual case, at C speed: a stable sort of the indices (ties: the lowest first).
        known = cast("Sequence[float]", smoothed)
        return sorted(range(len(known)), key=known.__getitem__)
    ranks = [r for r, up in enumerate(alive) if up]
    measured = sorted((smoothed[r], r) for r in ranks if smoothed[r] is not None)
    unmeasured = [r for r in ranks if smoothed[r] is None]
    if speed_hint is not None:
        unmeasured.sort(key=lambda r: (-speed_hint[r], r))
    return [r for _, r in measured] + unmeasured


# --- speeds to batch counts -----------------------------------------------------------------------


def relative_counts(anchor: int, weights: Sequence[float], cap: float | None) -> list[int]:
    """Counts ``∝ weights`` where the smallest weight gets ``anchor``; each at least 1."""
    low = min(weights)
    ratios = [w / low if cap is None else min(w / low, cap) for w in weights]
    return [max(1, round(anchor * r)) for r in ratios]


def speed_counts(
    anchor: int, smoothed: Sequence[float | None], anchor_rank: int, fallback: Sequence[int]
) -> list[int]:
    """``round(anchor * min(slow_ms / ms_r, 64))`` per rank, at least 1.

    ``slow_ms`` is the anchor rank's smoothed ms/batch. Ranks without a speed keep their
    ``fallback`` count; a zero ms/batch (a clock too coarse for the step) counts as the cap.
    """
    slow = smoothed[anchor_rank]
    if slow is not None and slow > 0 and None not in smoothed:
        known = cast("Sequence[float]", smoothed)
        if min(known) > 0:  # every rank measured, none at 0 ms: one pass
            return [max(1, round(anchor * min(slow / ms, MAX_SPEED_RATIO))) for ms in known]
    out = []
    for rank, ms in enumerate(smoothed):
        if ms is None or slow is None:
            out.append(fallback[rank])
            continue
        if slow <= 0:
            ratio = 1.0
        elif ms <= 0:
            ratio = MAX_SPEED_RATIO
        else:
            ratio = min(slow / ms, MAX_SPEED_RATIO)
        out.append(max(1, round(anchor * ratio)))
    return out


def apply_dead_zone(target: Sequence[int], previous: Sequence[int]) -> list[int]:
    """Keep each previous count unless its target moved by more than :data:`DEAD_ZONE`."""
    if list(target) == list(previous):  # settled counts (the usual case): nothing moved
        return list(previous)
    return [t if abs(t - p) > DEAD_ZONE * p else p for t, p in zip(target, previous, strict=True)]


def bound_spread(counts: Sequence[int], max_batch_diff: int | None) -> list[int]:
    """Clamp fast ranks so that ``max(counts) - min(counts) <= max_batch_diff`` (None: no bound)."""
    if max_batch_diff is None:
        return list(counts)
    ceiling = min(counts) + max_batch_diff
    return [min(c, ceiling) for c in counts]


def clamp_window(counts: Sequence[int], remaining: int, order: Sequence[int]) -> list[int]:
    """Fit one window into the ``remaining`` batches of the epoch.

    ``order`` lists the alive ranks, fastest first; every other rank gets 0. When the plan fits
    it is returned as is. Otherwise each alive rank keeps 1 batch and the rest is shared in
    proportion to ``count - 1`` (integer floor), the leftover going one by one to the fastest
    ranks; never above a rank's planned count. With fewer batches than alive ranks, the
    fastest ranks get one each.
    """
    out = [0] * len(counts)
    if remaining <= 0 or not order:
        return out
    if remaining < len(order):
        for rank in order[:remaining]:
            out[rank] = 1
        return out
    everyone = len(order) == len(counts)
    total = sum(counts) if everyone else sum(counts[r] for r in order)
    if total <= remaining:
        if everyone:
            return list(counts)
        for rank in order:
            out[rank] = counts[rank]
        return out
    extra, spare = remaining - len(order), total - len(order)
    for rank in order:
        out[rank] = 1 + (counts[rank] - 1) * extra // spare
    leftover = remaining - sum(out)
    for rank in order:
        if leftover == 0:
            break
        if out[rank] < counts[rank]:
            out[rank] += 1
            leftover -= 1
    return out
