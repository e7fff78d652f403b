"""ZeRO-1 on unequal devices: each rank steps, and keeps optimizer state for, its own pieces only.

``cluster.memory_plan: shard`` in ``nccl_sync`` (docs/guides/memory-plans.md). Every rank
holds the whole model and, after the gradient all-reduce, the whole averaged gradient, so the
update of any element can be computed on any rank; the optimizer *state* (Adam: two copies of
the model) is what does not fit a small device. :class:`ShardedOptimizer` steps only the
intervals of the flat parameter space this rank owns (the cut: :mod:`.shard_cut`), over leaf
tensors that are views of the parameters' own storage, so its step writes the new values in
place; :meth:`ShardedOptimizer.exchange` then broadcasts each owner's intervals to the others,
and every rank holds the same weights again.

Unlike torch's ``ZeroRedundancyOptimizer`` (whole parameters, even shares), pieces cut through
parameters (a model that is one large matrix still shards) and shares follow free memory.
This is valid for elementwise optimizers only (the update of an element reads that element's
gradient and state and per-group scalars): :data:`ELEMENTWISE`.

Before the cohort has cut (and in a cohort that does not shard) the optimizer is *whole*: it
steps the plain optimizer ``factory`` built (or, as the fallback of ``auto``, a
:class:`~flodl.step.plan_elements.HostOptimizer`), so it is exactly the plan without sharding. Its
``param_groups`` are always the plain optimizer's (schedulers, clipping and the LR scaling see
them); their hyper-parameters are handed to the pieces at each step.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.rig import links
from flodl.runtime.sync import groups
from flodl.runtime.sync.shard_cut import Cut, Interval
from flodl.runtime.sync.shard_state import Assembler, Piece, entries, is_sharded, sharded_dict

log = logging.getLogger(__name__)

#: Optimizers whose update of an element reads only that element (and per-group scalars).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
)


def elementwise(optimizer: torch.optim.Optimizer) -> bool:
    inner = getattr(optimizer, "inner", optimizer)  # a HostOptimizer steps its inner one
    return isinstance(inner, ELEMENTWISE)


class ShardedOptimizer(torch.optim.Optimizer):
    """The plain optimizer ``plain`` (built by ``factory`` over the model's parameters),
    stepping only this rank's pieces once :meth:`assign` gave it a cut. ``storage`` returns
    the one contiguous buffer the trainable parameters live in (None: they do not), in which
    the exchange broadcasts in place."""

    def __init__(
        self,
        plain: torch.optim.Optimizer,
        factory: Callable[[Any], torch.optim.Optimizer],
        trainable: Sequence[nn.Parameter],
        storage: Callable[[], torch.Tensor | None] = lambda: None,
    ) -> None:
        self.factory = factory
        self.whole: torch.optim.Optimizer = plain  # what steps until (unless) the cohort cuts
        self._storage = storage
        super().__init__([dict(g) for g in plain.param_groups], dict(plain.defaults))
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.numels = [p.numel() for p in self._params]
        # Each trainable parameter's place in the flat space (FlatState's order).
        place, pos = {}, 0
        for p in trainable:
            place[id(p)] = pos
            pos += p.numel()
        self.n = pos
        self._place = [place.get(id(p)) for p in self._params]
        self.cut: Cut = {}
        self.free: dict[int, int | None] = {}  # each rank's free bytes, as the cut was made
        self.state_cost = 0  # the whole state's bytes on a device, as measured for the cut
        self.rank = -1
        self.pieces: list[Piece] = []
        self._leaves: list[nn.Parameter] = []
        self.inner: torch.optim.Optimizer | None = None  # over the pieces, once cut
        self.state = plain.state  # what the rig adopts as the device's optimizer state

    # -- the cut ---------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.inner is not None

    def replace_whole(self, optimizer: torch.optim.Optimizer) -> None:
        """The cohort does not shard and this rank keeps its state on the host instead
        (``auto``'s fallback to ``offload``): ``optimizer`` steps from now on."""
        self.whole = optimizer
        self.state = optimizer.state

    def pieces_of(self, intervals: Sequence[Interval]) -> list[Piece]:
        """The pieces (parameter index, lo, hi) that ``intervals`` of the flat space cover,
        one per interval and parameter."""
        out = []
        for lo, hi in intervals:
            for i, start in enumerate(self._place):
                if start is None:
                    continue
                a, b = max(lo, start), min(hi, start + self.numels[i])
                if a < b:
                    out.append((i, a - start, b - start))
        return out

    def assign(self, cut: Cut, rank: int) -> int:
        """Own ``cut[rank]`` from now on. State this rank held for pieces it keeps is kept;
        new pieces start afresh. Returns how many elements start afresh."""
        old = self._entries()
        pieces = self.pieces_of(cut.get(rank, []))
        assembler = Assembler(pieces)
        assembler.add(old)
        states, fresh = assembler.result()
        self.cut = {r: list(ivs) for r, ivs in cut.items()}
        self.rank = rank
        self._build(pieces, states)
        self.whole.state.clear()  # the whole optimizer's state (if any) is not kept
        return fresh

    def _build(self, pieces: list[Piece], states: Sequence[dict[str, Any] | None]) -> None:
        self.pieces = pieces
        self._leaves = []
        for i, lo, hi in pieces:
            p = self._params[i]
            if not p.is_contiguous():  # a piece must be a view of the parameter's storage
                raise ValueError(
                    f"memory_plan=shard: parameter {i} (shape {tuple(p.shape)}) is not "
                    "contiguous, so no piece of it can be a view; use offload"
                )
            self._leaves.append(nn.Parameter(p.detach().view(-1)[lo:hi], requires_grad=True))
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        inner = self.factory([nn.Parameter(torch.zeros(1))])  # its class and defaults
        inner.param_groups = []
        inner.state = collections.defaultdict(dict)
        for g, group in enumerate(self.param_groups):
            leaves = [
                leaf
                for leaf, (i, _, _) in zip(self._leaves, pieces, strict=True)
                if group_of[id(self._params[i])] == g
            ]
            inner.add_param_group(
                {k: v for k, v in group.items() if k != "params"} | {"params": leaves}
            )
        for leaf, st in zip(self._leaves, states, strict=True):
            if st is not None:
                inner.state[leaf] = {
                    k: v.to(leaf.device) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
                    for k, v in st.items()
                }
        self.inner = inner
        self.state = inner.state

    def _entries(self) -> list[tuple[Piece, dict[str, Any]]]:
        """The state held now, as pieces."""
        if self.inner is None:
            return entries(self.whole.state_dict(), self.numels)
        return [
            (piece, dict(self.inner.state[leaf]))
            for piece, leaf in zip(self.pieces, self._leaves, strict=True)
            if leaf in self.inner.state
        ]

    # -- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ShardedOptimizer: closures are not supported (one step per call)")
        if self.inner is None:
            self._hyper(self.whole)
            return self.whole.step()
        self._hyper(self.inner)
        for leaf, (i, lo, hi) in zip(self._leaves, self.pieces, strict=True):
            grad = self._params[i].grad
            leaf.grad = None if grad is None else grad.reshape(-1)[lo:hi]
        self.inner.step()
        for leaf in self._leaves:
            leaf.grad = None
        return None

    def _hyper(self, target: torch.optim.Optimizer) -> None:
        """The outer groups' hyper-parameters (a scheduler, the LR scaling changed them)."""
        for outer, inner in zip(self.param_groups, target.param_groups, strict=True):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.inner is None:
            self.whole.zero_grad(set_to_none)

    @torch.no_grad()
    def exchange(self, members: Sequence[int], doomed: Callable[[], bool] | None = None) -> int:
        """Broadcast every owner's intervals from it to the others (``members``: the global
        ranks of the current group, in group order). Returns the bytes this rank received."""
        if self.inner is None:
            return 0
        storage = self._storage()
        works, received, pending = [], 0, []
        world = len(members)
        for src, owner in enumerate(members):
            for lo, hi in self.cut.get(owner, []):
                buf = storage[lo:hi] if storage is not None else self._gather(lo, hi)
                works.append(dist.broadcast(buf, src=src, async_op=True))
                links.broadcast(links.tensor_bytes(buf), world)
                if owner != self.rank:
                    received += links.tensor_bytes(buf)
                    if storage is None:
                        pending.append((lo, hi, buf))
        for work in works:
            if doomed is not None and dist.get_backend() == "gloo":
                groups.wait(work, doomed)
            else:
                work.wait()
        for lo, hi, buf in pending:
            self._scatter(lo, hi, buf)
        return received

    def _gather(self, lo: int, hi: int) -> torch.Tensor:
        parts = [self._params[i].detach().view(-1)[a:b] for i, a, b in self.pieces_of([(lo, hi)])]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _scatter(self, lo: int, hi: int, flat: torch.Tensor) -> None:
        pos = 0
        for i, a, b in self.pieces_of([(lo, hi)]):
            self._params[i].detach().view(-1)[a:b].copy_(flat[pos : pos + b - a])
            pos += b - a

    # -- state -----------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return sum(
            v.numel() * v.element_size()
            for s in self.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def state_dict(self) -> dict[str, Any]:
        """Whole: the plain optimizer's. Sharded: this rank's pieces in the sharded format
        (flodl/runtime/sync/shard_state.py), hyper-parameters numbered as the plain one's."""
        if self.inner is None:
            self._hyper(self.whole)
            return self.whole.state_dict()
        groups_ = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups_.append({k: v for k, v in g.items() if k != "params"} | {
                "params": list(range(start, start + n))
            })  # fmt: skip
            start += n
        held = self._entries()
        return sharded_dict(groups_, self.numels, [p for p, _ in held], [s for _, s in held])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A plain state dict or one rank's sharded one (what it does not cover of this rank's
        pieces starts afresh); :meth:`load_shards` reads several."""
        self.load_shards([state_dict])

    def load_shards(self, shards: Sequence[Any], what: str = "the checkpoint") -> int:
        """Load this rank's state from saved optimizer states (plain or sharded, in any mix;
        items may be callables that load one when called, so one is in memory at a time).
        Returns the elements whose state was not found (they start afresh, warned)."""
        if self.inner is None:  # whole: a plain state dict (sharded ones are joined first)
            from flodl.runtime.sync.shard_state import to_plain

            loaded = [s() if callable(s) else s for s in shards]
            if any(is_sharded(s) for s in loaded):
                plain, fresh = to_plain(loaded, [p.shape for p in self._params])
            else:
                plain, fresh = loaded[0], 0
            self.whole.load_state_dict(plain)
            self._groups_from(plain)
            return fresh
        assembler = Assembler(self.pieces)
        groups_from = None
        for s in shards:
            sd = s() if callable(s) else s
            assembler.add(entries(sd, self.numels))
            groups_from = groups_from or sd
            del sd
        states, fresh = assembler.result()
        self._build(self.pieces, states)
        if groups_from is not None:
            self._groups_from(groups_from)
        if fresh:
            log.warning(
                "rank %d: %s holds no optimizer state for %d of the %d elements this rank "
                "owns (%.1f MiB of state lost with a rank that wrote none); they start afresh",
                self.rank,
                what,
                fresh,
                sum(hi - lo for _, lo, hi in self.pieces),
                fresh * self._bytes_per_element() / 2**20,
            )
        return fresh

    def _bytes_per_element(self) -> int:
        """Optimizer state bytes per element owned (0 before the first step)."""
        owned = sum(hi - lo for _, lo, hi in self.pieces)
        return self.state_bytes() // owned if owned else 0

    def _groups_from(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("param_groups") or []
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"the saved optimizer has {len(saved)} parameter groups, this one "
                f"{len(self.param_groups)}"
            )
        for outer, g in zip(self.param_groups, saved, strict=True):
            outer.update({k: v for k, v in g.items() if k != "params"})
