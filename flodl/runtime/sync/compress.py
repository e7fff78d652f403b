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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from flodl.rig import links
from flodl.runtime.sync import groups

BLOCK = 4096  # int8: values per scale
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Compressor:
    """One rank's side of compressed averaging: the shared reference and (int8) the error
    feedback."""

    def __init__(self, kind: str) -> None:
        if kind not in (*WIRE_DTYPES, "int8"):
            raise ValueError(f"elche.compress={kind!r}: one of none, bf16, fp16, int8")
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
        if self.kind == "int8":
            reduced = self._int8_sum(change, group, doomed)
        else:
            wire = change.to(WIRE_DTYPES[self.kind])
            _wait(dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group, async_op=True), doomed)
            nbytes = links.tensor_bytes(wire)
            self.sent_bytes += nbytes
            links.all_reduce(nbytes, dist.get_world_size(group))
            reduced = wire.to(torch.float32)
        return reduced.add_(self.ref)

    def _int8_sum(
        self,
        change: torch.Tensor,
        group: dist.ProcessGroup | None,
        doomed: Callable[[], bool] | None,
    ) -> torch.Tensor:
        if self.residual is not None and self.residual.shape == change.shape:
            change.add_(self.residual)
        q, scales = quantize(change)
        self.residual = change.sub_(dequantize(q, scales, change.numel()))
        world = dist.get_world_size(group)
        qs = [torch.empty_like(q) for _ in range(world)]
        ss = [torch.empty_like(scales) for _ in range(world)]
        _wait(dist.all_gather(qs, q, group=group, async_op=True), doomed)
        _wait(dist.all_gather(ss, scales, group=group, async_op=True), doomed)
        nbytes = links.tensor_bytes(q) + links.tensor_bytes(scales)
        self.sent_bytes += nbytes
        link = links.installed()
        if link is not None:
            link.charge(link.wire.all_gather_s(nbytes, world), nbytes)
        total = torch.zeros_like(change)
        for q_r, s_r in zip(qs, ss, strict=True):
            total.add_(dequantize(q_r, s_r, change.numel()))
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
