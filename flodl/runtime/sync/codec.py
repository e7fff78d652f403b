"""Compressed averaging through the controller (``elche.compress`` in ``cpu_sync``,
``cpu_cadence`` and ``cpu_async``): snapshots up and averages down in half or a quarter of the
bytes, while every rank's fp32 weights stay exactly what the controller holds.

The controller names each average it sends by its window (its *version*) and keeps it, fp32,
as a *reference*; a rank keeps the last one it took. Both directions then carry only a change
against a reference both ends hold bit for bit, packed by the :mod:`compress` codec
(``bf16``/``fp16``: 2 bytes a value; ``int8``: 1 byte a value and one fp32 scale per block of
4096, the block's padding never sent):

* **up**: rank ``r`` holding reference ``v`` sends ``P_r = pack(W_r - ref_v + e_r)`` with the
  version ``v`` (int8: ``e_r``, the error feedback, is what the last packing lost, so nothing
  is lost for good). The controller sums ``w_r * unpack(P_r)`` as the pieces stream in, adds
  ``(sum of the w_r against v) * ref_v`` once per version, and divides by the weights: the same
  weighted mean as whole snapshots, up to each change's rounding;
* **down**: the controller packs the mean ``M`` against the version ``b`` it last sent those
  ranks, ``Q = pack(M - ref_b + e)``, and *defines* the new consensus as
  ``A = ref_b + unpack(Q)`` (``e``: int8's error feedback on this side). It keeps ``A`` as
  version ``k`` (the window) and sends every rank the same ``Q``; each adds it to its own
  ``ref_b`` and gets ``A`` bit for bit (the same fp32 additions of the same numbers). So a
  cadence run's ranks hold identical weights after every average, as uncompressed.

cpu_async's ranks take averages at different times (and blend them in, EASGD-style): a report
may be against any version the rank took, so the controller keeps every version a rank may
still report against: from the oldest one a member last reported against (or was first sent)
up to the newest, about ``max_overshoot + 2`` copies. Averages reach a rank in the order they
were sent, so the version a down change is packed against is always the one the rank holds when
it takes it. A window whose ranks were last sent different versions goes whole.

Whatever goes uncompressed sets the reference again: the first average, the first after a
regroup (:meth:`ConsensusCodec.forget`; the ranks drop theirs when they take the Regroup,
which every later average follows on the channel), and a resume (fresh processes, fresh
controller). A report against a version the controller no longer holds cannot be summed: its
window averages nothing (as a tainted one), and the ranks keep their weights.

Only what is averaged travels: the flat state (trainable parameters, then float buffers).
The controller holds the versions in memory (one fp32 copy each, ``cpu_cadence``: two), where
uncompressed averaging keeps none; a rank holds its reference (one copy) and, int8, its residual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from flodl.config.registries.codecs import CODECS
from flodl.runtime.sync.compress import codec_for

log = logging.getLogger(__name__)

KINDS = tuple(CODECS)


@dataclass(frozen=True)
class Packed:
    """A change of ``n`` fp32 values against reference version ``base``, as it travels.
    ``scales`` (int8: one fp32 per block of :data:`BLOCK` values; else None) is declared
    before ``values`` so it is streamed first: a receiver summing the values as they arrive
    has the scales by then. In a message looked at before its tensors arrive, the two
    tensor fields hold placeholders (hence ``Any``)."""

    kind: str
    base: int
    n: int
    scales: Any
    values: Any

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (what a modelled link charges for it)."""
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return int(self.values.numel() * self.values.element_size() + scales)


def pack(kind: str, change: torch.Tensor, base: int) -> Packed:
    """``change`` (fp32, 1-D) in the wire form of ``kind``."""
    n = change.numel()
    values, scales = codec_for(kind).encode(change)
    if values.numel() != n:  # a block's padding is not sent
        values = values[:n].clone()
    return Packed(kind, base, n, scales, values)


def unpack(packed: Packed) -> torch.Tensor:
    """The change ``packed`` carries, fp32."""
    return codec_for(packed.kind).decode(packed.values, packed.scales, packed.n)


def unpack_piece(kind: str, piece: torch.Tensor, offset: int, scales: Any) -> torch.Tensor:
    """Values ``offset..`` of a streamed change, fp32 (a scaled codec: ``offset`` is on a
    block)."""
    return codec_for(kind).decode_piece(piece, offset, scales)


def wire_dtype(kind: str) -> torch.dtype:
    return codec_for(kind).dtype


class RankCodec:
    """A rank's side: the reference it took last (fp32, on the host) and int8's residual."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"elche.compress={kind!r}: one of none, {', '.join(KINDS)}")
        self.kind = kind
        self.ref: torch.Tensor | None = None
        self.version = -1  # the window of the average ``ref`` is
        self.residual: torch.Tensor | None = None
        self.sent_bytes = 0  # snapshots, packed or whole (tests, telemetry)

    def invalidate(self) -> None:
        """The reference may no longer be the controller's (a regroup, a resume)."""
        self.ref, self.version, self.residual = None, -1, None

    @torch.no_grad()
    def snapshot(self, flat: torch.Tensor) -> Packed | None:
        """This rank's weights ``flat`` as a change against its reference; None without one
        (the snapshot then goes whole)."""
        if self.ref is None:
            self.sent_bytes += flat.numel() * 4
            return None
        change = flat.detach().to("cpu", torch.float32, copy=True).sub_(self.ref)
        feedback = CODECS[self.kind].error_feedback
        if feedback and self.residual is not None:
            change.add_(self.residual)
        packed = pack(self.kind, change, self.version)
        if feedback:  # what this packing lost goes with the next change
            self.residual = change.sub_(unpack(packed))
        self.sent_bytes += packed.nbytes
        return packed

    @torch.no_grad()
    def receive(self, window: int, payload: Any) -> torch.Tensor | None:
        """The average of ``window`` (``payload``: a change against our reference, or the
        whole vector), fp32 on the host, now also our reference: the caller may change the
        returned tensor. None when a change is against a reference we do not hold (never
        expected: see the module docstring); we then keep our weights and report whole."""
        if isinstance(payload, Packed):
            if self.ref is None or payload.base != self.version:
                log.warning(
                    "average of window %d is a change against version %d, this rank holds %d; "
                    "not taken (the next snapshot goes whole)",
                    window,
                    payload.base,
                    self.version,
                )
                self.invalidate()
                return None
            self.ref.add_(unpack(payload))
        else:
            # A copy: an in-process link hands over the controller's own tensor.
            self.ref = payload.detach().to("cpu", torch.float32, copy=True)
        self.version = window
        return self.ref.clone()


class ConsensusCodec:
    """The controller's side: the versions ranks may hold, what each was sent last, and
    int8's residual of the averages sent down. Used from the controller's thread only."""

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"elche.compress={kind!r}: one of none, {', '.join(KINDS)}")
        self.kind = kind
        self.refs: dict[int, torch.Tensor] = {}  # version -> the consensus it names
        self.held: dict[int, int] = {}  # rank -> the version it last reported against
        self.given: dict[int, int] = {}  # rank -> the version last sent it (it holds it next)
        self.first_given: dict[int, int] = {}  # rank -> the first version sent since a reset
        self.residual: torch.Tensor | None = None
        self.residual_base = -1  # the version the residual is the loss of
        self.whole_windows: list[int] = []  # averages sent uncompressed (telemetry, tests)

    def ref(self, version: int) -> torch.Tensor | None:
        return self.refs.get(version)

    def reported(self, rank: int, base: int | None) -> None:
        """``rank``'s snapshot of a window being averaged was a change against ``base``
        (None: whole). A whole one after a change means the rank dropped its reference (see
        :meth:`RankCodec.receive`): its next average goes whole."""
        if base is not None:
            self.held[rank] = base
        elif self.held.pop(rank, None) is not None:
            self.given.pop(rank, None)

    @torch.no_grad()
    def down(self, window: int, mean: torch.Tensor, ranks: list[int]) -> torch.Tensor | Packed:
        """What to send ``ranks`` for ``window``'s average ``mean`` (consumed: it becomes the
        consensus, kept as version ``window``): a change against the version they were sent
        last, or ``mean`` whole when they were not all sent the same one."""
        bases = {self.given.get(r) for r in ranks}
        base = bases.pop() if len(bases) == 1 else None
        ref = self.refs.get(base) if base is not None else None
        payload: torch.Tensor | Packed
        if ref is None:
            self.residual, self.residual_base = None, -1
            self.whole_windows.append(window)
            payload = mean
        else:
            assert base is not None
            change = mean.sub_(ref)  # the mean's memory holds the change, then the consensus
            feedback = CODECS[self.kind].error_feedback
            if feedback and self.residual is not None and self.residual_base == base:
                change.add_(self.residual)
            payload = pack(self.kind, change, base)
            sent = unpack(payload)
            if feedback:
                self.residual, self.residual_base = change.sub(sent), window
            mean.copy_(ref).add_(sent)  # the consensus: what every rank computes from Q
        self.refs[window] = mean
        for r in ranks:
            self.given[r] = window
            self.first_given.setdefault(r, window)
        self._prune()
        return payload

    def forget(self) -> None:
        """A new membership: the survivors drop their references when they take the Regroup,
        so whatever goes down from now on goes whole. The versions stay until the first
        average after it (a report already on its way may be against one of them)."""
        self.given.clear()
        self.first_given.clear()
        self.held.clear()
        self.residual, self.residual_base = None, -1

    def _prune(self) -> None:
        """Drop the versions older than any a member may still report against: the one it
        last reported against, or the first it was sent (it has not reported against any)."""
        if not self.first_given:
            return
        floor = min(self.held.get(r, first) for r, first in self.first_given.items())
        for version in [v for v in self.refs if v < floor]:
            del self.refs[version]
