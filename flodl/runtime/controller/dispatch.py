"""Dispatch: hand out consecutive chunks of each epoch's permutation and prove coverage.

Every rank derives the same permutation from ``seed + epoch``
(``flodl.data.source.epoch_permutation``);
the controller only deals in ``(offset, size)`` ranges of it. A window gives rank ``r`` the next
``counts[r] * batch_size`` samples, so chunks are progressive and throughput-proportional once
ElChe has calibrated. With per-rank batch sizes a rank's batches are its own size, so equal
counts give sample shares in the ratio of the sizes. :class:`Coverage` checks that every sample
of every epoch was trained exactly once.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flodl.runtime.wire.messages import Chunk

if TYPE_CHECKING:
    from flodl.config import CallbackPolicy, TrainerConfig
    from flodl.elche import ElChe
    from flodl.runtime.controller.membership import Membership


@dataclass
class EpochCursor:
    """What is left of one epoch's permutation, handed out front first.

    Normally one range ``[0, n)`` consumed in order; after a resume or a lost rank it is the
    list of uncovered ranges, so the same mechanism reassigns work without training a sample
    twice.
    """

    epoch: int
    n_samples: int
    batch_size: int
    ranges: list[Chunk] = field(default_factory=list)
    boundaries: Sequence[int] = ()  # sharded data: shard starts in the epoch's order (sorted)

    def __post_init__(self) -> None:
        if not self.ranges:
            self.ranges = [(0, self.n_samples)] if self.n_samples > 0 else []

    @property
    def remaining_samples(self) -> int:
        return sum(size for _, size in self.ranges)

    @property
    def remaining_batches(self) -> int:
        return sum(math.ceil(size / self.batch_size) for _, size in self.ranges)

    @property
    def done(self) -> bool:
        return not self.ranges

    def take(
        self, counts: Sequence[int], sizes: Sequence[int] | None = None
    ) -> list[tuple[Chunk, ...]]:
        """Give rank ``r`` the next ``counts[r]`` batches of ``sizes[r]`` samples (default: the
        cursor's batch size); a rank with count 0 gets nothing."""
        sizes = sizes if sizes is not None else [self.batch_size] * len(counts)
        if len(self.ranges) == 1 and not self.boundaries:
            return self._take_from_one_range(counts, sizes)
        return [self._take_batches(count, size) for count, size in zip(counts, sizes, strict=True)]

    def _take_from_one_range(
        self, counts: Sequence[int], sizes: Sequence[int]
    ) -> list[tuple[Chunk, ...]]:
        """:meth:`_take_batches` for every rank when one range is left and no shard bounds
        (a run's normal case): each rank's part is one slice, cut in one pass."""
        (offset, left) = self.ranges[0]
        out: list[tuple[Chunk, ...]] = []
        for count, size in zip(counts, sizes, strict=True):
            n = min(count * size, left) if count > 0 else 0
            out.append(((offset, n),) if n > 0 else ())
            offset, left = offset + n, left - n
        self.ranges = [(offset, left)] if left > 0 else []
        return out

    def _take_batches(self, count: int, batch_size: int) -> tuple[Chunk, ...]:
        chunks: list[Chunk] = []
        while count > 0 and self.ranges:
            offset, size = self.ranges[0]
            batches = math.ceil(size / batch_size)
            if batches <= count:
                chunks.append((offset, size))
                self.ranges.pop(0)
                count -= batches
            else:
                cut = self._to_boundary(offset, count * batch_size, size)
                if cut >= size:
                    chunks.append((offset, size))
                    self.ranges.pop(0)
                    break
                chunks.append((offset, cut))
                self.ranges[0] = (offset + cut, size - cut)
                count = 0
        return tuple(chunks)

    def _to_boundary(self, offset: int, cut: int, size: int) -> int:
        """Sharded data: the cut moved up to the next shard start, so a rank gets whole
        shards (a window's share rounds up by less than one shard)."""
        if not self.boundaries:
            return cut
        i = bisect.bisect_left(self.boundaries, offset + cut)
        return size if i == len(self.boundaries) else min(size, self.boundaries[i] - offset)

    def give_back(self, chunks: Sequence[Chunk]) -> None:
        """Return ranges whose training was lost (a dead rank's work) to the front."""
        self.ranges = sorted([*chunks, *self.ranges])


def count_batches(chunks: Sequence[Chunk], batch_size: int) -> int:
    """Number of batches (the last possibly partial) the chunks make (as a rank cuts them:
    :func:`flodl.data.source.count_batches`)."""
    return sum(math.ceil(size / batch_size) for _, size in chunks)


def clamp_to_samples(counts: Sequence[int], sizes: Sequence[int], remaining: int) -> list[int]:
    """Scale batch counts of unequal batch sizes down so the window fits the epoch's
    ``remaining`` samples (proportionally, each rank that had work keeps at least one batch)."""
    need = sum(c * s for c, s in zip(counts, sizes, strict=True))
    if need <= remaining or need == 0:
        return list(counts)
    scale = remaining / need
    return [max(1, math.ceil(c * scale)) if c > 0 else 0 for c in counts]


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
        trained = self.trained.get(epoch)  # once a report: no empty default list each time
        if trained is None:
            self.trained[epoch] = list(chunks)
        else:
            trained.extend(chunks)

    def unrecord(self, epoch: int, chunks: Sequence[Chunk]) -> None:
        """Forget ranges whose training was lost with their rank (they are trained again)."""
        trained = self.trained.get(epoch, [])
        for chunk in chunks:
            if chunk in trained:
                trained.remove(chunk)

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


@dataclass(frozen=True)
class EvalSchedule:
    """The trainer knobs that say when and where the eval runs (a slice of ``TrainerConfig``)."""

    every: int  # trainer.eval_every: evaluate every N epochs (and after the last)
    policy: str  # trainer.eval_policy: "elected" (one rank) or "sharded" (every member)
    callback: CallbackPolicy  # trainer.callback_policy: which rank is elected

    @classmethod
    def of(cls, cfg: TrainerConfig) -> EvalSchedule:
        return cls(cfg.eval_every, cfg.eval_policy, cfg.callback_policy)


def eval_shards(
    evals: EvalSchedule,
    has_eval: bool,
    epoch: int,
    last: bool,
    members: Membership,
    elche: ElChe | None,
) -> dict[int, tuple[int, int]]:
    """Which ranks evaluate after ``epoch`` (``last``: the run's last epoch), each with its
    ``(shard, shards)`` (``elche``: None under one rank)."""
    if not has_eval or not (last or (epoch + 1) % evals.every == 0):
        return {}
    alive = members.members
    if evals.policy == "sharded":
        return {r: (i, len(alive)) for i, r in enumerate(alive)}
    policy = evals.callback
    if policy.kind == "rank" and members.alive[policy.rank]:
        return {policy.rank: (0, 1)}
    if elche is not None:
        return {elche.fastest_rank(alive=members.alive): (0, 1)}
    return {alive[0] if alive else 0: (0, 1)}
