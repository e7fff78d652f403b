"""Averaging weights and the cpu_async overshoot bound.

Parameters are averaged in proportion to the work each rank did since the last average
(``w_r ∝ batches_r ** gamma``), so a fast rank that took 25 steps counts more than a slow one
that took 10. Float buffers (BatchNorm running stats) are statistics, not trained values, and
are averaged equally. A rank that took no step has nothing new to contribute and is excluded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flodl.elche.guard import Verdict

#: Absolute ceiling of cpu_async's overshoot bound, whatever the epoch size or the user says.
MAX_OVERSHOOT_CEILING = 15


def _check_batches(batches: Sequence[int]) -> None:
    if not batches:
        raise ValueError("batches=[]: needs one entry per rank")
    # C-level passes first (one entry a rank: 128 at 128 ranks); anything but plain ints >= 0
    # is then looked at entry by entry.
    plain = set(map(type, batches)) == {int} and min(batches) >= 0
    if not plain and any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in batches):
        raise ValueError(f"batches={list(batches)}: every entry must be an integer >= 0")
    if not any(batches):
        raise ValueError(f"batches={list(batches)}: no rank stepped, there is nothing to average")


def averaging_weights(batches: Sequence[int], gamma: float) -> list[float]:
    """Parameter weights ``∝ batches_r ** gamma`` over the ranks that stepped; they sum to 1.

    ``gamma=1`` weights by work, ``gamma=0`` is equal among ranks that stepped, ``gamma=-1``
    makes every *step* count equally (a rank's whole window weighs ``1/batches``).
    Raises ValueError when no rank stepped or an entry is negative.
    """
    _check_batches(batches)
    if not math.isfinite(gamma):
        raise ValueError(f"gamma={gamma}: must be a finite number")
    if gamma == 1.0:  # x ** 1.0 is x: the common case, at C speed
        raw = list(map(float, batches))
    else:
        raw = [float(b) ** gamma if b > 0 else 0.0 for b in batches]
    total = math.fsum(raw)
    return [w / total for w in raw]


def buffer_weights(batches: Sequence[int]) -> list[float]:
    """Float-buffer weights: equal among ranks with ``batches > 0``, 0 for the others."""
    _check_batches(batches)
    stepped = len(batches) - list(batches).count(0)  # entries are ints >= 0 (checked)
    if stepped == len(batches):
        return [1.0 / stepped] * stepped
    return [1.0 / stepped if b > 0 else 0.0 for b in batches]


def auto_max_overshoot(total_batches_per_epoch: int) -> tuple[int, int]:
    """cpu_async's automatic overshoot bound: ``(initial, cap)`` for an epoch of this size.

    ``initial = clamp(total // 100, 2, 5)``, ``cap = clamp(total // 50, 3, 10)``: a longer epoch
    tolerates more windows of run-ahead before the average lands. Both stay under
    :data:`MAX_OVERSHOOT_CEILING`.
    """
    if isinstance(total_batches_per_epoch, bool) or total_batches_per_epoch < 0:
        raise ValueError(f"total_batches_per_epoch={total_batches_per_epoch}: must be >= 0")
    initial = min(max(total_batches_per_epoch // 100, 2), 5, MAX_OVERSHOOT_CEILING)
    cap = min(max(total_batches_per_epoch // 50, 3), 10, MAX_OVERSHOOT_CEILING)
    return initial, cap


def step_max_overshoot(current: int, verdict: Verdict, initial: int, cap: int) -> int:
    """The overshoot bound after one averaging cycle: +1 per Stable verdict up to ``cap``,
    back to ``initial`` on NudgeDown, unchanged on SuppressGrowth."""
    if verdict is Verdict.NUDGE_DOWN:
        return initial
    if verdict is Verdict.STABLE:
        return min(current + 1, cap, MAX_OVERSHOOT_CEILING)
    return current
