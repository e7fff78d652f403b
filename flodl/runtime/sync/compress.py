"""Compressed averaging (``elche.compress``): an average in half or a quarter of the bytes.

Every rank holds the last average (the *reference*: bit for bit the same on every rank, as the
all-reduce left it), so an average needs only each rank's weighted change since then:
``W = ref + sum_r w_r (W_r - ref)`` (the weights sum to one). Only that change travels, in
``bf16`` or ``fp16`` (an all-reduce of half the bytes), or in ``int8`` with a scale per block
of 4096 values and error feedback (what one rounding lost is added to the next change, so
nothing is lost for good; an all-gather of a quarter of the bytes on two ranks, ``(N-1)/N`` of
``N`` quarters on ``N``). The fp32 weights stay exact on every rank: the reference and the sum
are fp32, and every rank adds the same reduced change to the same reference.

The reference is a copy of the weights (one more copy per rank). It is dropped whenever the
ranks may no longer share it (a failed average, a new membership, a resume); the next average is
then sent uncompressed and sets it again.

Each codec is declared once (flodl/config/registries/codecs.py: its wire dtype, error feedback,
whether a collective all-reduces its values or all-gathers its encodings) and implemented here as a
:class:`WireCodec` (:func:`codec_for`); nothing below branches on a codec's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from flodl.config import resolve_dotted
from flodl.config.registries.codecs import CODECS, COMPRESS_NAMES, CodecSpec
from flodl.rig import links
from flodl.runtime.sync import groups

BLOCK = 4096  # int8: values per scale
WIRE_DTYPES = {s.name: getattr(torch, s.wire_dtype) for s in CODECS.values() if not s.scaled}


class WireCodec:
    """A codec's torch side: a change (fp32, 1-D) encoded as ``(values, scales)`` (``scales``:
    None unless the codec is ``scaled``) and decoded back. Subclasses implement ``encode`` and
    ``decode``; ``decode_piece`` decodes values ``offset..`` of a streamed encoding."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.dtype: torch.dtype = getattr(torch, spec.wire_dtype)

    def encode(self, change: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None, n: int) -> torch.Tensor:
        raise NotImplementedError

    def decode_piece(
        self, piece: torch.Tensor, offset: int, scales: torch.Tensor | None
    ) -> torch.Tensor:
        return self.decode(piece, scales, piece.numel())


class CastCodec(WireCodec):
    """The change cast to a narrower float (bf16, fp16): sums in that dtype (an all-reduce)."""

    def encode(self, change: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return change.to(self.dtype), None

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None, n: int) -> torch.Tensor:
        return values.to(torch.float32)


class Int8Codec(WireCodec):
    """Symmetric int8 with one fp32 scale per block of :data:`BLOCK` values (:func:`quantize`);
    the encoding keeps its last block's padding (a collective's tensors are whole blocks)."""

    def encode(self, change: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return quantize(change)

    def decode(self, values: torch.Tensor, scales: torch.Tensor | None, n: int) -> torch.Tensor:
        assert scales is not None
        return dequantize(values, scales, n)

    def decode_piece(
        self, piece: torch.Tensor, offset: int, scales: torch.Tensor | None
    ) -> torch.Tensor:
        assert scales is not None and offset % BLOCK == 0, "int8 pieces start on a block"
        first = offset // BLOCK
        blocks = -(-piece.numel() // BLOCK)
        return dequantize(piece, scales[first : first + blocks], piece.numel())


@functools.cache
def codec_for(name: str) -> WireCodec:
    """The codec ``elche.compress=name`` names (its registry entry's ``impl``)."""
    if name not in CODECS:
        raise ValueError(f"elche.compress={name!r}: one of {', '.join(COMPRESS_NAMES)}")
    spec = CODECS[name]
    codec: WireCodec = resolve_dotted(spec.impl)(spec)
    return codec


class Compressor:
    """One rank's side of compressed averaging: the shared reference and (int8) the error
    feedback."""

    def __init__(self, kind: str) -> None:
        self.codec = codec_for(kind)
        self.kind = kind
        self.ref: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self.sent_bytes = 0  # what this rank put on the wire for averages (tests, telemetry)

    def reset(self, current: torch.Tensor) -> None:
        """The ranks agree on ``current`` (an average just landed): it is the new reference."""
        if self.ref is None or self.ref.shape != current.shape:
            self.ref = current.detach().clone()
        else:
            self.ref.copy_(current)

    def invalidate(self) -> None:
        self.ref = None
        self.residual = None

    @torch.no_grad()
    def average(
        self,
        flat: torch.Tensor,
        weight: float,
        buffer_weight: float,
        n_params: int,
        group: dist.ProcessGroup | None = None,
        doomed: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """The average of ``flat`` (this rank's state, fp32, consumed) over the group."""
        assert self.ref is not None
        change = flat.sub_(self.ref)
        change[:n_params] *= weight
        change[n_params:] *= buffer_weight
        if self.codec.spec.collective == "all_gather":
            reduced = self._gathered_sum(change, group, doomed)
        else:  # the encoding sums as it is: an all-reduce of the narrower values
            wire, _ = self.codec.encode(change)
            _wait(dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True), doomed)
            nbytes = links.tensor_bytes(wire)
            self.sent_bytes += nbytes
            links.all_reduce(nbytes, dist.get_world_size(group))
            reduced = self.codec.decode(wire, None, change.numel())
        return reduced.add_(self.ref)

    def _gathered_sum(
        self,
        change: torch.Tensor,
        group: dist.ProcessGroup | None,
        doomed: Callable[[], bool] | None,
    ) -> torch.Tensor:
        """Each rank's encoded change gathered and decoded, summed in fp32 (a codec whose
        encodings do not sum as they are: int8's scales differ by rank)."""
        feedback = self.codec.spec.error_feedback
        if feedback and self.residual is not None and self.residual.shape == change.shape:
            change.add_(self.residual)
        q, scales = self.codec.encode(change)
        decoded = self.codec.decode(q, scales, change.numel())
        self.residual = change.sub_(decoded) if feedback else None
        world = dist.get_world_size(group)
        parts = [q] if scales is None else [q, scales]
        gathered = [[torch.empty_like(t) for _ in range(world)] for t in parts]
        for out, t in zip(gathered, parts, strict=True):
            _wait(dist.all_gather(out, t, group=group, async_op=True), doomed)
        nbytes = sum(links.tensor_bytes(t) for t in parts)
        self.sent_bytes += nbytes
        link = links.installed()
        if link is not None:
            link.charge(link.wire.all_gather_s(nbytes, world), nbytes)
        total = torch.zeros_like(change)
        for r in range(world):
            s_r = gathered[1][r] if scales is not None else None
            total.add_(self.codec.decode(gathered[0][r], s_r, change.numel()))
        return total


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of BLOCK values: ``(q, scales)`` with ``x ~ q * scale``."""
    pad = (-x.numel()) % BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(blocks / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales.to(torch.float32)


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` values back from ``quantize``'s ``(q, scales)``; ``q`` may be cut short of its
    last block's padding (the controller's modes send only the ``n`` values)."""
    pad = (-q.numel()) % BLOCK
    if pad:
        q = torch.cat([q.reshape(-1), q.new_zeros(pad)])
    return (q.view(-1, BLOCK).to(torch.float32) * scales[:, None]).view(-1)[:n]


def _wait(work: dist.Work, doomed: Callable[[], bool] | None) -> None:
    if doomed is not None and dist.get_backend() == "gloo":
        groups.wait(work, doomed)
    else:
        work.wait()
