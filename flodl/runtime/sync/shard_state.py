"""Optimizer state in pieces: the sharded format of a checkpoint, and state re-cut to new pieces.

A *piece* is ``(index, lo, hi)``: elements ``[lo, hi)`` of the parameter at ``index`` in the
plain optimizer's order (its ``state_dict``'s numbering, over its ``param_groups``). A rank of a
sharded cohort holds optimizer state for its pieces only, and its checkpoint shard says so::

    {"state": {}, "param_groups": [...as the plain optimizer's...],
     "zero": {"format": 1, "numels": [...], "pieces": [[index, lo, hi], ...],
              "states": [{"exp_avg": 1-D tensor of hi - lo, "step": ..., ...}, ...]}}

The plain format is the special case of whole parameters, so both read the same way
(:func:`entries`): a list of pieces with their state. :class:`Assembler` builds the state of the
pieces a rank owns now from whatever pieces were saved (one rank's shard after another, so
only one is in memory at a time): an elementwise tensor (one value per element: Adam's moments,
SGD's momentum) is cut and joined; a step count is the smallest of the parts' (:func:`_join`).
A piece the saved ones do not cover whole starts afresh (no state): half a moment next to a
step count of thousands would take steps far larger than the learning rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

Piece = tuple[int, int, int]  # (parameter index, lo, hi)
FORMAT = 1


def is_sharded(state_dict: Mapping[str, Any] | None) -> bool:
    """A sharded optimizer state (this module's format), not a plain one."""
    return isinstance(state_dict, Mapping) and isinstance(state_dict.get("zero"), Mapping)


def _elementwise(value: Any, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == length


def entries(state_dict: Mapping[str, Any], numels: Sequence[int]) -> list[tuple[Piece, dict]]:
    """The pieces a state dict holds, with their state (tensors flattened to 1-D)."""
    if is_sharded(state_dict):
        zero = state_dict["zero"]
        pieces = [tuple(int(x) for x in p) for p in zero["pieces"]]
        return [((p[0], p[1], p[2]), dict(s)) for p, s in zip(pieces, zero["states"], strict=True)]
    out = []
    for index, st in (state_dict.get("state") or {}).items():
        i = int(index)
        n = numels[i]
        flat = {k: v.reshape(-1) if _elementwise(v, n) else v for k, v in st.items()}
        out.append(((i, 0, n), flat))
    return out


def sharded_dict(
    param_groups: Sequence[Mapping[str, Any]],
    numels: Sequence[int],
    pieces: Sequence[Piece],
    states: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The sharded format (see the module docstring); ``param_groups`` as the plain
    optimizer's ``state_dict`` numbers them."""
    return {
        "state": {},
        "param_groups": [dict(g) for g in param_groups],
        "zero": {
            "format": FORMAT,
            "numels": list(numels),
            "pieces": [list(p) for p in pieces],
            "states": [dict(s) for s in states],
        },
    }


class Assembler:
    """The state of ``wanted`` pieces, gathered from saved pieces fed in any order."""

    def __init__(self, wanted: Sequence[Piece]) -> None:
        self.wanted = list(wanted)
        # per wanted piece: (lo, hi, state slices) of the saved parts that overlap it
        self._parts: list[list[tuple[int, int, dict[str, Any]]]] = [[] for _ in self.wanted]
        self._by_index: dict[int, list[int]] = {}
        for k, (i, _, _) in enumerate(self.wanted):
            self._by_index.setdefault(i, []).append(k)

    def add(self, saved: Iterable[tuple[Piece, Mapping[str, Any]]]) -> None:
        """Take what overlaps the wanted pieces (copies: the saved state may be let go)."""
        for (i, slo, shi), st in saved:
            for k in self._by_index.get(i, ()):
                _, lo, hi = self.wanted[k]
                a, b = max(lo, slo), min(hi, shi)
                if a >= b:
                    continue
                cut = {
                    key: v[a - slo : b - slo].clone() if _elementwise(v, shi - slo) else v
                    for key, v in st.items()
                }
                self._parts[k].append((a, b, cut))

    def result(self) -> tuple[list[dict[str, Any] | None], int]:
        """Per wanted piece its state (None: not covered whole, starts afresh), and how many
        elements start afresh."""
        out: list[dict[str, Any] | None] = []
        fresh = 0
        for (_, lo, hi), parts in zip(self.wanted, self._parts, strict=True):
            parts.sort(key=lambda p: p[0])
            pos, chain = lo, []
            for a, b, st in parts:
                if a == pos:
                    chain.append(st)
                    pos = b
            if pos != hi or not chain:
                out.append(None)
                fresh += hi - lo
                continue
            out.append(_join(chain))
        return out, fresh


def _join(chain: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive parts of one piece joined: elementwise tensors concatenated; a scalar
    (Adam's step count) the smallest of the parts' (parts saved by ranks that took over a lost
    rank's state at different times differ: the smallest count is the conservative one, its
    bias correction the larger)."""
    joined = {}
    for key, v in chain[0].items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            joined[key] = torch.cat([c[key] for c in chain]) if len(chain) > 1 else v
        elif isinstance(v, torch.Tensor | int | float) and not isinstance(v, bool):
            joined[key] = min((c[key] for c in chain), key=float)
        else:
            joined[key] = v
    return joined


def to_plain(
    shards: Iterable[Mapping[str, Any]], shapes: Sequence[torch.Size]
) -> tuple[dict[str, Any], int]:
    """A plain optimizer ``state_dict`` (whole parameters of ``shapes``) from sharded shards;
    also how many elements' state no shard held (those parameters start afresh)."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    wanted = [(i, 0, n) for i, n in enumerate(numels) if n > 0]
    assembler = Assembler(wanted)
    groups: list[dict[str, Any]] | None = None
    for sd in shards:
        assembler.add(entries(sd, numels))
        groups = groups or [dict(g) for g in sd["param_groups"]]
    states, fresh = assembler.result()
    plain: dict[Any, Any] = {}
    for (i, _, n), st in zip(wanted, states, strict=True):
        if st is not None:
            plain[i] = {k: v.reshape(shapes[i]) if _elementwise(v, n) else v for k, v in st.items()}
    return {"state": plain, "param_groups": groups or []}, fresh
