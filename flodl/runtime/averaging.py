"""How ranks agree on one set of weights: weighted parameter averaging (collective or controller).

Parameters are averaged weighted by the work each rank did (weights from ``flodl.elche``); float
buffers (BatchNorm statistics) equally among the ranks that stepped; integer buffers stay local.
Everything travels as one flat vector: one collective per window, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


class FlatState:
    """A model's parameters and float buffers viewed as one flat vector."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters()]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.n_params = sum(p.numel() for p in self.params)

    def flatten(self) -> torch.Tensor:
        tensors = [t.detach().reshape(-1) for t in (*self.params, *self.buffers)]
        if not tensors:
            return torch.zeros(0)
        return torch.cat([t.to(torch.float32) for t in tensors])

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        pos = 0
        for t in (*self.params, *self.buffers):
            n = t.numel()
            t.copy_(flat[pos : pos + n].view_as(t).to(t.dtype))
            pos += n

    def divergence(self, before: torch.Tensor, after: torch.Tensor) -> float:
        """``||W_before - W_after|| / ||W_after||`` over parameters (the guard's signal)."""
        b, a = before[: self.n_params], after[: self.n_params]
        denom = float(torch.linalg.vector_norm(a))
        return float(torch.linalg.vector_norm(b - a)) / denom if denom > 0 else 0.0


def collective_average(
    state: FlatState, weight: float, buffer_weight: float, group: dist.ProcessGroup | None = None
) -> None:
    """Weighted all-reduce of the flat state, in place: one collective whatever the model."""
    scaled = state.flatten()
    scaled[: state.n_params] *= weight
    scaled[state.n_params :] *= buffer_weight
    dist.all_reduce(scaled, op=dist.ReduceOp.SUM, group=group)
    state.load(scaled)


def weighted_mean(
    flats: Sequence[torch.Tensor],
    weights: Sequence[float],
    buffer_weights: Sequence[float],
    n_params: int,
) -> torch.Tensor:
    """The controller's CPU average of rank snapshots (``cpu_*`` modes)."""
    out = torch.zeros_like(flats[0], dtype=torch.float32)
    for flat, w, bw in zip(flats, weights, buffer_weights, strict=True):
        if w:
            out[:n_params].add_(flat[:n_params], alpha=w)
        if bw:
            out[n_params:].add_(flat[n_params:], alpha=bw)
    return out


def broadcast_from(state: FlatState, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank start from ``src``'s weights."""
    flat = state.flatten().to(state.params[0].device if state.params else "cpu")
    dist.broadcast(flat, src=src, group=group)
    state.load(flat)
