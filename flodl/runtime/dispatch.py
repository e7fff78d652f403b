"""Dispatch: hand out consecutive chunks of each epoch's permutation and prove coverage.

Every rank derives the same permutation from ``seed + epoch`` (``flodl.data.epoch_permutation``);
the controller only deals in ``(offset, size)`` ranges of it. A window gives rank ``r`` the next
``counts[r] * batch_size`` samples, so chunks are progressive and throughput-proportional once
ElChe has calibrated. :class:`Coverage` checks that every sample of every epoch was trained
exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flodl.runtime.messages import Chunk


@dataclass
class EpochCursor:
    """The monotonic cursor over one epoch's permutation."""

    epoch: int
    n_samples: int
    batch_size: int
    offset: int = 0

    @property
    def remaining_samples(self) -> int:
        return self.n_samples - self.offset

    @property
    def remaining_batches(self) -> int:
        return math.ceil(self.remaining_samples / self.batch_size)

    @property
    def done(self) -> bool:
        return self.offset >= self.n_samples

    def take(self, counts: Sequence[int]) -> list[tuple[Chunk, ...]]:
        """Give rank ``r`` the next ``counts[r]`` batches; a rank with count 0 gets nothing."""
        chunks: list[tuple[Chunk, ...]] = []
        for count in counts:
            size = min(count * self.batch_size, self.remaining_samples)
            if size <= 0:
                chunks.append(())
                continue
            chunks.append(((self.offset, size),))
            self.offset += size
        return chunks


def chunk_batches(chunks: Sequence[Chunk], batch_size: int) -> int:
    """Number of batches (the last possibly partial) the chunks make."""
    return sum(math.ceil(size / batch_size) for _, size in chunks)


def proportional_counts(ratios: Sequence[float], total: int) -> list[int]:
    """Split ``total`` batches by ``ratios`` (largest remainders), at least 1 each when possible."""
    scale = sum(ratios)
    raw = [total * r / scale for r in ratios]
    counts = [max(1, int(x)) if total >= len(ratios) else int(x) for x in raw]
    order = sorted(range(len(ratios)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    i = 0
    while sum(counts) < total and order:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > total:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    return counts


@dataclass
class Coverage:
    """Which ranges of each epoch were trained; exact when they tile ``[0, n)`` once."""

    n_samples: int
    trained: dict[int, list[Chunk]] = field(default_factory=dict)

    def record(self, epoch: int, chunks: Sequence[Chunk]) -> None:
        self.trained.setdefault(epoch, []).extend(chunks)

    def uncovered(self, epoch: int) -> list[Chunk]:
        """Ranges of the epoch not trained yet (used to reassign a lost rank's work)."""
        gaps: list[Chunk] = []
        pos = 0
        for offset, size in sorted(self.trained.get(epoch, [])):
            if offset > pos:
                gaps.append((pos, offset - pos))
            pos = max(pos, offset + size)
        if pos < self.n_samples:
            gaps.append((pos, self.n_samples - pos))
        return gaps

    def overlaps(self, epoch: int) -> int:
        """Samples trained more than once in the epoch."""
        extra = 0
        pos = 0
        for offset, size in sorted(self.trained.get(epoch, [])):
            if offset < pos:
                extra += min(pos, offset + size) - offset
            pos = max(pos, offset + size)
        return extra

    def exact(self, epoch: int) -> bool:
        return not self.uncovered(epoch) and self.overlaps(epoch) == 0

    def to_dict(self) -> dict[str, object]:
        return {
            "n_samples": self.n_samples,
            "per_epoch": [
                {"epoch": e, "uncovered": self.uncovered(e), "overlaps": self.overlaps(e)}
                for e in sorted(self.trained)
            ],
        }
