"""Who owns which part of the optimizer state (``cluster.memory_plan: shard``): the cut.

ZeRO-1 (torch's ``ZeroRedundancyOptimizer``) hands each rank whole parameters, evenly. On
unequal devices that wastes the big one and overfills the small ones, and a model that is one
large matrix cannot be split at all. Here the trainable parameters are one flat space
``[0, n)`` (their order in :class:`~flodl.runtime.sync.averaging.FlatState`), and each rank
owns intervals of it, sized in proportion to the device memory it has free for optimizer
state::

    free_r  = budget_r x memory_fraction - (its probe step's peak without optimizer state)
    bound_k = n x (free_0 + ... + free_k) // (free_0 + ... + free_last)
    rank k owns [bound_(k-1), bound_k)

With optimizer state proportional to the elements owned (elementwise optimizers), every rank's
share then fills the same fraction of its free memory, so the cut fits iff the cohort's free
memory holds the whole state. Integer arithmetic on numbers every rank gathered: every rank
computes the same cut. An interval may cut through a parameter; parameter groups need no cut of
their own (the sharded optimizer keeps each piece in its group: flodl/runtime/sync/
sharded_optimizer.py).

A lost rank's intervals go to the survivors, split in the same proportion (:func:`reassign`),
so the survivors keep what they owned and its state; only the lost intervals start afresh.
Pure: no torch, no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Interval = tuple[int, int]
#: Global rank -> the intervals of the flat parameter space it owns.
Cut = dict[int, list[Interval]]

MiB = 1 << 20


def _weights(free: Mapping[int, int | None]) -> dict[int, int]:
    """Each rank's weight in a cut: its free bytes; a rank without a budget (None) counts as
    roomy as the roomiest counted one; when no rank is counted, all weigh the same."""
    known = [f for f in free.values() if f is not None]
    roomy = max(known, default=1) if any(f > 0 for f in known) else 1
    weights = {r: roomy if f is None else max(int(f), 0) for r, f in free.items()}
    if not any(weights.values()):
        return dict.fromkeys(free, 1)
    return weights


def _split(lo: int, hi: int, weights: Mapping[int, int]) -> dict[int, Interval]:
    """``[lo, hi)`` cut in consecutive parts, one per rank (in rank order), in proportion."""
    total = sum(weights.values())
    parts, acc, start = {}, 0, lo
    for r in sorted(weights):
        acc += weights[r]
        end = lo + (hi - lo) * acc // total
        parts[r] = (start, end)
        start = end
    return parts


def proportional_cut(n: int, free: Mapping[int, int | None]) -> Cut:
    """One contiguous interval of ``[0, n)`` per rank of ``free`` (rank -> free bytes, None:
    not counted), in rank order, sized in proportion; a rank with nothing free owns nothing."""
    if not free:
        return {}
    return {r: [iv] if iv[1] > iv[0] else [] for r, iv in _split(0, n, _weights(free)).items()}


def reassign(cut: Cut, survivors: Sequence[int], free: Mapping[int, int | None]) -> Cut:
    """``cut`` after losing every rank not in ``survivors``: each lost interval is split among
    the survivors in proportion to their free memory and added to what they own (kept apart
    from their own intervals, so the state of those stays whole)."""
    alive = sorted(survivors)
    new: Cut = {r: list(cut.get(r, [])) for r in alive}
    if not alive:
        return new
    weights = _weights({r: free.get(r) for r in alive})
    for gone in sorted(set(cut) - set(alive)):
        for lo, hi in cut[gone]:
            for r, (a, b) in _split(lo, hi, weights).items():
                if b > a:
                    new[r].append((a, b))
    return new


def owned(cut: Cut, rank: int) -> int:
    """Elements ``rank`` owns."""
    return sum(hi - lo for lo, hi in cut.get(rank, []))


def lost_intervals(cut: Cut, survivors: Sequence[int]) -> list[tuple[int, Interval]]:
    """The (rank, interval) pairs of ranks not in ``survivors``."""
    return [(r, iv) for r in sorted(cut) if r not in survivors for iv in cut[r]]


@dataclass(frozen=True)
class Demand:
    """What one rank tells the cohort before the cut: whether its plan asks for ``shard``
    (``wants``; ``auto``: chosen by the probe, so it may fall back to ``offload``), the device
    memory it has free for optimizer state (None: not counted) and what the whole optimizer
    state costs on its device (its probe step with it, less its step without; 0: not known)."""

    rank: int
    wants: bool
    auto: bool
    free: int | None
    state: int


@dataclass(frozen=True)
class Decision:
    """The cohort's verdict: shard with ``cut``; or not (``cut`` empty), the ranks in
    ``fallback`` keeping their state on the host instead; ``error``: an explicit ``shard``
    the cohort cannot hold (the message gives the numbers)."""

    cut: Cut
    fallback: tuple[int, ...] = ()
    error: str = ""

    @property
    def sharded(self) -> bool:
        return bool(self.cut)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.1f} MiB"


def decide(demands: Sequence[Demand], n: int) -> Decision:
    """Shard when some rank asks for it and every rank's share of the state fits its free
    memory (``share x state <= free``); otherwise the ranks that chose it by ``auto`` fall back
    to ``offload``, and an explicit ``shard`` is an error naming the numbers."""
    if not any(d.wants for d in demands) or n <= 0:
        return Decision({})
    cut = proportional_cut(n, {d.rank: d.free for d in demands})
    short = [
        d
        for d in demands
        if d.free is not None and d.state > 0 and owned(cut, d.rank) * d.state > d.free * n
    ]
    if not short:
        return Decision(cut)
    wanting = [d for d in demands if d.wants]
    if all(d.auto for d in wanting):
        return Decision({}, fallback=tuple(d.rank for d in wanting))
    state = max(d.state for d in demands)
    free = ", ".join(
        f"rank {d.rank}: {'not counted' if d.free is None else _size(max(d.free, 0))}"
        for d in demands
    )
    total = sum(max(d.free or 0, 0) for d in demands)
    return Decision(
        {},
        error=(
            f"cluster.memory_plan=shard: the cohort's free device memory ({free}; "
            f"{_size(total)} in all) cannot hold the optimizer state ({_size(state)}) even "
            "sharded in proportion; use memory_plan=offload (state on the host), or give the "
            "ranks more memory"
        ),
    )
