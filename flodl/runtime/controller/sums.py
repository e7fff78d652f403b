"""The controller's cpu_* average, summed while the snapshots arrive (no snapshot held whole).

A rank's snapshot (its flat weights) reaches the launcher in frames; the reader thread adds each
piece into the window's running sum, scaled by the rank's unnormalised weight (``samples **
gamma`` for parameters, 1 for float buffers of a rank that stepped), and the controller divides
by the totals once every report of the window is in. So the launcher holds one vector per window
being averaged (plus a small receive buffer per rank) instead of one per rank, and the sum is
done by the time the last byte arrived: receiving and averaging overlap.

A rank lost half way through its snapshot leaves a sum it partly entered: such a window is
*tainted* and averages nothing (the ranks keep their weights, and the next round averages
them). A sum no longer needed (a voided window) is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flodl.runtime.wire.channel import PIECE_BYTES  # bytes added per step (the lock grid of a sum)
from flodl.runtime.wire.messages import Report
from flodl.runtime.wire.streaming import Placeholder


def unnormalised(samples: int, batches: int, gamma: float) -> tuple[float, float]:
    """A rank's weights before normalisation: ``(samples ** gamma, 1)`` if it stepped, else 0."""
    if samples <= 0 or batches <= 0:
        return 0.0, 0.0
    return float(samples) ** gamma, 1.0


@dataclass
class _Sum:
    flat: torch.Tensor
    n_params: int
    locks: list[threading.Lock]
    touched: list[bool]
    weights: dict[int, tuple[float, float]] = field(default_factory=dict)  # finished ranks
    started: set[int] = field(default_factory=set)

    def add(self, weights: tuple[float, float], offset: int, piece: torch.Tensor) -> None:
        """Add ``piece`` (elements ``offset..``, within one lock cell) scaled by ``weights``."""
        cell = offset * 4 // PIECE_BYTES
        end = offset + piece.numel()
        # The sum starts at zero: a cell may be entered in several pieces (frames need not be
        # piece-aligned), so "the first piece initialises the cell" would leave part of it unset.
        with self.locks[cell]:
            self.touched[cell] = True
            for lo, hi, w in (
                (offset, min(end, self.n_params), weights[0]),
                (max(offset, self.n_params), end, weights[1]),
            ):
                if hi > lo and w:
                    self.flat[lo:hi].add_(piece[lo - offset : hi - offset], alpha=w)


class SnapshotSums:
    """Running sums of the ranks' snapshots, one per window; thread-safe (one reader per rank)."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.n_params = 0  # set once the ranks are ready
        self._lock = threading.Lock()
        self._sums: dict[int, _Sum] = {}

    def route(self, msg: Any, descriptors: list) -> dict[int, Callable[[int, memoryview], None]]:
        """For :meth:`flodl.runtime.wire.channel.Channel.recv`: a Report's snapshot is summed."""
        if not isinstance(msg, Report) or not _is_placeholder(msg.snapshot) or not self.n_params:
            return {}
        index = msg.snapshot.index
        dtype, shape = descriptors[index]
        if dtype != "float32" or len(shape) != 1:
            return {}
        weights = unnormalised(msg.samples, msg.batches, self.gamma)
        total = self._open(msg.window, int(shape[0]))
        with self._lock:
            total.started.add(msg.rank)
        return {index: partial_adder(total, msg.rank, weights, int(shape[0]))}

    def _open(self, window: int, n: int) -> _Sum:
        with self._lock:
            total = self._sums.get(window)
            if total is None:
                cells = max(1, -(-n * 4 // PIECE_BYTES))
                total = _Sum(
                    torch.zeros(n),
                    self.n_params,
                    [threading.Lock() for _ in range(cells)],
                    [False] * cells,
                )
                self._sums[window] = total
            return total

    def add_whole(self, report: Report) -> None:
        """A snapshot that arrived whole (an in-process rank's): sum it like a streamed one."""
        flat = report.snapshot.detach().reshape(-1).to(torch.float32)
        total = self._open(report.window, flat.numel())
        with self._lock:
            total.started.add(report.rank)
        consume = partial_adder(
            total,
            report.rank,
            unnormalised(report.samples, report.batches, self.gamma),
            flat.numel(),
        )
        step = PIECE_BYTES // 4
        for lo in range(0, flat.numel(), step):
            piece = flat[lo : lo + step]
            consume(lo * 4, memoryview(piece.numpy()).cast("B"))

    def take(self, window: int, ranks: list[int]) -> torch.Tensor | None:
        """The weighted mean of ``ranks``' snapshots of ``window``, or None: tainted (a rank's
        snapshot was cut off half way, or is missing, or nothing was summed)."""
        with self._lock:
            total = self._sums.pop(window, None)
        if total is None or total.started != set(total.weights) or set(ranks) != set(total.weights):
            return None
        w_params = sum(total.weights[r][0] for r in ranks)
        w_buffers = sum(total.weights[r][1] for r in ranks)
        if w_params <= 0 or not all(total.touched):
            return None
        total.flat[: total.n_params].div_(w_params)
        if w_buffers > 0:
            total.flat[total.n_params :].div_(w_buffers)
        return total.flat

    def drop(self, keep_from: int) -> None:
        """Forget the sums of windows before ``keep_from`` (averaged or voided)."""
        with self._lock:
            for window in [w for w in self._sums if w < keep_from]:
                del self._sums[window]


def partial_adder(
    total: _Sum, rank: int, weights: tuple[float, float], n: int
) -> Callable[[int, memoryview], None]:
    """A consumer of one snapshot's bytes (``(byte offset, piece)``); the last piece marks the
    rank as finished (its weights then count)."""

    def consume(byte_offset: int, piece: memoryview) -> None:
        values = torch.frombuffer(piece, dtype=torch.float32)
        total.add(weights, byte_offset // 4, values)
        if byte_offset + len(piece) == n * 4:
            total.weights[rank] = weights

    return consume


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, Placeholder)


__all__ = ["PIECE_BYTES", "SnapshotSums", "unnormalised"]
