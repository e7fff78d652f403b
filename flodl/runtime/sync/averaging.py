"""How ranks agree on one set of weights: weighted parameter averaging (collective or controller).

Parameters that train (``requires_grad``: a frozen base never travels, see :mod:`.trainable`) are
averaged weighted by the work each rank did (weights from ``flodl.elche``); float buffers
(BatchNorm statistics) equally among the ranks that stepped; integer buffers stay local.
Everything travels as one flat vector: one collective per window, whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from flodl.rig import links
from flodl.runtime.sync import groups
from flodl.runtime.sync.compress import Compressor
from flodl.runtime.sync.trainable import trainable

_SPAN = 1 << 20  # elements per span of a span-by-span pass (4 MiB of float32 temporaries)


class FlatState:
    """A model's trainable parameters and float buffers viewed as one flat vector: what every
    mode averages and sends (frozen parameters are not in it: :mod:`.trainable`).

    With ``share_storage`` (the runtime's own replicas) the tensors are re-pointed into one
    contiguous buffer, so averaging is a scale and one in-place all-reduce: no gather, no copy
    back. It is done before the optimizer exists, and checked before every use: a module that
    re-assigns a buffer (instead of updating it in place) quietly drops back to gather/copy.
    """

    def __init__(self, model: nn.Module, share_storage: bool = False) -> None:
        self.params = trainable(model)
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.n_params = sum(p.numel() for p in self.params)
        self.storage: torch.Tensor | None = None
        self._ptrs: list[int] = []
        tensors = [*self.params, *self.buffers]
        uniform = len({(t.dtype, t.device) for t in tensors}) == 1
        if share_storage and tensors and uniform and tensors[0].dtype == torch.float32:
            self._share(tensors)

    @torch.no_grad()
    def _share(self, tensors: list[torch.Tensor]) -> None:
        storage = torch.cat([t.detach().reshape(-1) for t in tensors])
        pos = 0
        for t in tensors:
            n = t.numel()
            t.data = storage[pos : pos + n].view_as(t)
            pos += n
        self.storage = storage
        self._ptrs = [t.data_ptr() for t in tensors]

    def shared(self) -> torch.Tensor | None:
        """The contiguous storage, if every tensor still lives in it."""
        if self.storage is None:
            return None
        if [t.data_ptr() for t in (*self.params, *self.buffers)] != self._ptrs:
            self.storage = None  # something re-assigned a tensor: gather/copy from now on
            return None
        return self.storage

    def flatten(self) -> torch.Tensor:
        """A copy of the state as one float32 vector (parameters first)."""
        storage = self.shared()
        if storage is not None:
            return storage.clone()
        tensors = [t.detach().reshape(-1) for t in (*self.params, *self.buffers)]
        if not tensors:
            return torch.zeros(0)
        return torch.cat([t.to(torch.float32) for t in tensors])

    @torch.no_grad()
    def finite(self) -> bool:
        """Every parameter and float buffer finite (checked span by span: no full-size mask)."""
        storage = self.shared()
        tensors = [storage] if storage is not None else [*self.params, *self.buffers]
        for t in tensors:
            flat = t.detach().reshape(-1)
            for lo in range(0, flat.numel(), _SPAN):
                if not bool(torch.isfinite(flat[lo : lo + _SPAN]).all()):
                    return False
        return True

    def current(self) -> torch.Tensor:
        """The state as one vector to read: the shared storage itself, else a copy."""
        storage = self.shared()
        return storage if storage is not None else self.flatten()

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        storage = self.shared()
        if storage is not None:
            storage.copy_(flat)
            return
        load_into((*self.params, *self.buffers), flat)

    @torch.no_grad()
    def divergence(self, before: torch.Tensor, after: torch.Tensor) -> float:
        """``||W_before - W_after|| / ||W_after||`` over parameters (the guard's signal),
        taken span by span: the difference never exists as a whole vector (no weight copy)."""
        b, a = before[: self.n_params], after[: self.n_params]
        denom = float(torch.linalg.vector_norm(a))
        if denom <= 0:
            return 0.0
        squares = 0.0
        for lo in range(0, self.n_params, _SPAN):
            diff = torch.sub(b[lo : lo + _SPAN], a[lo : lo + _SPAN])
            squares += float(torch.linalg.vector_norm(diff)) ** 2
        return math.sqrt(squares) / denom


def collective_average(
    state: FlatState,
    weight: float,
    buffer_weight: float,
    group: dist.ProcessGroup | None = None,
    doomed: Callable[[], bool] | None = None,
    measure: bool = False,
    compressor: Compressor | None = None,
) -> float | None:
    """Weighted all-reduce of the flat state: one collective whatever the model. The reduction
    runs on a scaled copy and lands only when it succeeded: a collective that fails half way
    (a peer died) leaves the rank's weights as they were, not scaled or partly summed. With
    ``doomed``, a gloo collective is given up (:class:`groups.Abandoned`) once it says so.
    ``measure``: return the divergence of the rank's weights from the average, taken before the
    average lands (so no pre-average copy of the weights is needed for the guard).
    ``compressor`` (``elche.compress``): only the weighted change since the last average travels,
    in fewer bytes; the first average (and the first after the ranks may disagree on the last
    one) goes uncompressed and sets the reference."""
    if compressor is not None and compressor.ref is not None:
        flat = state.flatten()
        averaged = compressor.average(
            flat, weight, buffer_weight, state.n_params, group=group, doomed=doomed
        )
        divergence = state.divergence(state.current(), averaged) if measure else None
        state.load(averaged)
        compressor.reset(averaged)
        return divergence
    with torch.no_grad():
        scaled = state.flatten()
        scaled[: state.n_params] *= weight
        scaled[state.n_params :] *= buffer_weight
    if doomed is not None and dist.get_backend(group) == "gloo":
        groups.wait(
            dist.all_reduce(scaled, op=dist.ReduceOp.SUM, group=group, async_op=True), doomed
        )
    else:
        dist.all_reduce(scaled, op=dist.ReduceOp.SUM, group=group)
    links.all_reduce(links.tensor_bytes(scaled), dist.get_world_size(group))
    divergence = state.divergence(state.current(), scaled) if measure else None
    state.load(scaled)
    if compressor is not None:
        compressor.reset(scaled)
    return divergence


@torch.no_grad()
def weighted_buffers(buffers: Sequence[torch.Tensor], weight: float) -> torch.Tensor:
    """The float buffers as one float32 vector times ``weight`` (a copy), to be summed."""
    return torch.cat([b.detach().reshape(-1).to(torch.float32) for b in buffers]).mul_(weight)


@torch.no_grad()
def load_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive spans of ``flat`` into ``tensors`` (each in its own shape and dtype):
    the inverse of concatenating them, as :meth:`FlatState.flatten` and
    :func:`weighted_buffers` do."""
    pos = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[pos : pos + n].view_as(t).to(t.dtype))
        pos += n


def weighted_mean(
    flats: Sequence[torch.Tensor],
    weights: Sequence[float],
    buffer_weights: Sequence[float],
    n_params: int,
    in_place: bool = False,
) -> torch.Tensor:
    """The controller's CPU average of rank snapshots (``cpu_*`` modes). ``in_place``: the
    snapshots are the caller's to consume, and the first becomes the average (no new vector:
    the controller holds the snapshots of one round and nothing else)."""
    if in_place and flats[0].dtype == torch.float32:
        out = flats[0]
        out[:n_params].mul_(weights[0])
        out[n_params:].mul_(buffer_weights[0])
        rest = zip(flats[1:], weights[1:], buffer_weights[1:], strict=True)
    else:
        out = torch.zeros_like(flats[0], dtype=torch.float32)
        rest = zip(flats, weights, buffer_weights, strict=True)
    for flat, w, bw in rest:
        if w:
            out[:n_params].add_(flat[:n_params], alpha=w)
        if bw:
            out[n_params:].add_(flat[n_params:], alpha=bw)
    return out


def broadcast_from(state: FlatState, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Make every rank start from ``src``'s weights."""
    flat = state.flatten().to(state.params[0].device if state.params else "cpu")
    dist.broadcast(flat, src=src, group=group)
    links.broadcast(links.tensor_bytes(flat), dist.get_world_size(group))
    state.load(flat)
