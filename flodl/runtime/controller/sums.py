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

With ``elche.compress`` a snapshot may be a :class:`~flodl.runtime.sync.codec.Packed` change
against a reference version: its values (bf16/fp16, or int8 after their block scales) are
unpacked piece by piece as they stream and summed the same way, and :meth:`SnapshotSums.take`
adds each version's reference once, weighted by the ranks that reported against it
(:mod:`flodl.runtime.sync.codec` has the formulas).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from flodl.runtime.sync.codec import ConsensusCodec, Packed, unpack_piece, wire_dtype
from flodl.runtime.sync.compress import BLOCK
from flodl.runtime.wire.channel import PIECE_BYTES  # bytes added per step (the lock grid of a sum)
from flodl.runtime.wire.messages import Report
from flodl.runtime.wire.streaming import Placeholder, nbytes, tensor_view

log = logging.getLogger(__name__)


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
    bases: dict[int, int] = field(default_factory=dict)  # rank -> version it sent a change against

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

    def add_span(self, weights: tuple[float, float], offset: int, values: torch.Tensor) -> None:
        """:meth:`add` for values that may cross lock cells (an unpacked piece of a change:
        a piece of 2- or 1-byte values spans two or four cells of fp32)."""
        cell = PIECE_BYTES // 4
        pos = 0
        while pos < values.numel():
            k = min(cell - (offset + pos) % cell, values.numel() - pos)
            self.add(weights, offset + pos, values[pos : pos + k])
            pos += k


class SnapshotSums:
    """Running sums of the ranks' snapshots, one per window; thread-safe (one reader per rank)."""

    def __init__(self, gamma: float, codec: ConsensusCodec | None = None) -> None:
        self.gamma = gamma
        self.codec = codec  # elche.compress: the versions changes are against
        self.n_params = 0  # set once the ranks are ready
        self.up_bytes = 0  # snapshot bytes received (telemetry: the summary's averaging bytes)
        self._lock = threading.Lock()
        self._sums: dict[int, _Sum] = {}

    def route(self, msg: Any, descriptors: list) -> dict[int, Callable[[int, memoryview], None]]:
        """For :meth:`flodl.runtime.wire.channel.Channel.recv`: a Report's snapshot is summed."""
        if not isinstance(msg, Report) or not self.n_params:
            return {}
        if isinstance(msg.snapshot, Packed) and self.codec is not None:
            return self._route_packed(msg, descriptors)
        if not _is_placeholder(msg.snapshot):
            return {}
        index = msg.snapshot.index
        dtype, shape = descriptors[index]
        if dtype != "float32" or len(shape) != 1:
            return {}
        weights = unnormalised(msg.samples, msg.batches, self.gamma)
        total = self._open(msg.window, int(shape[0]))
        with self._lock:
            total.started.add(msg.rank)
            self.up_bytes += nbytes(descriptors[index])
        return {index: partial_adder(total, msg.rank, weights, int(shape[0]))}

    def _route_packed(self, msg: Report, descriptors: list) -> dict[int, Callable]:
        """A change against a version: its scales (int8) then its values, unpacked and summed
        as they arrive. A malformed one is left to arrive whole (and is refused at the sum)."""
        packed: Packed = msg.snapshot
        n, kind = packed.n, packed.kind
        values = packed.values
        scales = packed.scales
        if not _is_placeholder(values) or (kind == "int8") != _is_placeholder(scales):
            return {}
        if tuple(descriptors[values.index]) != (str(wire_dtype(kind)).removeprefix("torch."), (n,)):
            return {}
        blocks = -(-n // BLOCK)
        if scales is not None and tuple(descriptors[scales.index]) != ("float32", (blocks,)):
            return {}
        weights = unnormalised(msg.samples, msg.batches, self.gamma)
        total = self._open(msg.window, n)
        with self._lock:
            total.started.add(msg.rank)
            total.bases[msg.rank] = packed.base
            claimed = [i.index for i in (scales, values) if i is not None]
            self.up_bytes += sum(nbytes(descriptors[i]) for i in claimed)
        take_scales, take_values = packed_adders(total, msg.rank, weights, kind, n)
        if scales is None:
            return {values.index: take_values}
        return {scales.index: take_scales, values.index: take_values}  # the scales first

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
        if isinstance(report.snapshot, Packed):
            if report.snapshot.values is not None:  # None: it was summed as it streamed
                self._add_packed_whole(report, report.snapshot)
            return
        flat = report.snapshot.detach().reshape(-1).to(torch.float32)
        with self._lock:
            self.up_bytes += flat.numel() * 4
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

    def _add_packed_whole(self, report: Report, packed: Packed) -> None:
        total = self._open(report.window, packed.n)
        with self._lock:
            total.started.add(report.rank)
            total.bases[report.rank] = packed.base
            self.up_bytes += packed.nbytes
        weights = unnormalised(report.samples, report.batches, self.gamma)
        take_scales, take_values = packed_adders(total, report.rank, weights, packed.kind, packed.n)
        for tensor, consume in ((packed.scales, take_scales), (packed.values, take_values)):
            if tensor is None:
                continue
            view = tensor_view(tensor.contiguous())
            for lo in range(0, len(view), PIECE_BYTES):
                consume(lo, view[lo : lo + PIECE_BYTES])

    def take(self, window: int, ranks: list[int]) -> torch.Tensor | None:
        """The weighted mean of ``ranks``' snapshots of ``window``, or None: tainted (a rank's
        snapshot was cut off half way, or is missing, or nothing was summed, or a change is
        against a version no longer held)."""
        with self._lock:
            total = self._sums.pop(window, None)
        if total is None or total.started != set(total.weights) or set(ranks) != set(total.weights):
            return None
        w_params = sum(total.weights[r][0] for r in ranks)
        w_buffers = sum(total.weights[r][1] for r in ranks)
        if w_params <= 0 or not all(total.touched) or not self._add_references(total, ranks):
            return None
        total.flat[: total.n_params].div_(w_params)
        if w_buffers > 0:
            total.flat[total.n_params :].div_(w_buffers)
        return total.flat

    def _add_references(self, total: _Sum, ranks: list[int]) -> bool:
        """Changes: add each version's reference once, weighted by the ranks that sent a
        change against it; False when one is no longer held. Tells the codec what each rank
        reported against."""
        if self.codec is None:
            return True
        n = total.n_params
        for base in sorted(set(total.bases.values())):
            ref = self.codec.ref(base)
            if ref is None:
                log.warning(
                    "a snapshot is a change against version %d, no longer held: its window "
                    "averages nothing",
                    base,
                )
                return False
            against = [r for r in ranks if total.bases.get(r) == base]
            w_params = sum(total.weights[r][0] for r in against)
            w_buffers = sum(total.weights[r][1] for r in against)
            total.flat[:n].add_(ref[:n], alpha=w_params)
            if w_buffers:
                total.flat[n:].add_(ref[n:], alpha=w_buffers)
        for rank in ranks:
            self.codec.reported(rank, total.bases.get(rank))
        return True

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


def packed_adders(
    total: _Sum, rank: int, weights: tuple[float, float], kind: str, n: int
) -> tuple[Callable[[int, memoryview], None], Callable[[int, memoryview], None]]:
    """Consumers of a packed change's bytes: its scales (int8; kept, a 1/1024 of the values'
    fp32 size), then its values, unpacked and summed piece by piece; the last piece marks the
    rank as finished. Pieces are aligned on PIECE_BYTES, so an int8 piece starts on a block."""
    dtype = wire_dtype(kind)
    size = torch.empty(0, dtype=dtype).element_size()
    scales = torch.empty(-(-n // BLOCK)) if kind == "int8" else None

    def take_scales(byte_offset: int, piece: memoryview) -> None:
        assert scales is not None
        raw = scales.view(torch.uint8)
        raw[byte_offset : byte_offset + len(piece)] = torch.frombuffer(piece, dtype=torch.uint8)

    def take_values(byte_offset: int, piece: memoryview) -> None:
        values = torch.frombuffer(piece, dtype=dtype)
        offset = byte_offset // size
        total.add_span(weights, offset, unpack_piece(kind, values, offset, scales))
        if byte_offset + len(piece) == n * size:
            total.weights[rank] = weights

    return take_scales, take_values


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, Placeholder)


__all__ = ["PIECE_BYTES", "SnapshotSums", "unnormalised"]
