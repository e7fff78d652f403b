"""The sync modes, each declared once: what the rest of flodl needs to know of a mode.

A mode is two objects: on each rank, the class that averages (its ``rank_side``, a class of
:mod:`flodl.runtime.rank.sync_modes`, chosen once when the rank is built), and here, its
:class:`ModePolicy`: what the planner (lock-step or ElChe's windows, overshoot, consensus
windows, settling, gradient sync), the aggregator (does the controller average snapshots, are
syncs counted, does compression apply), ElChe, the placement and the validator read instead of
branching on the mode's name. :data:`MODES` is the registry: the schema's ``elche.mode``, the
presets of ``conf/elche/``, the docs' table (docs/design/modes.md) and the code all read it.

Adding a mode: a :class:`Mode` member and its :class:`ModePolicy` in :data:`MODES` (a rank-side
class of its own only when none of the existing ones does what it needs), its tests, a line in
docs/guides/modes-elche.md (docs/design/registries.md walks through an example).
Pure: no torch (the config and the Hydra plugin import it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any


class Mode(str, Enum):
    """Averaging mode (docs/design/modes.md); ``nccl`` = the collective backend (NCCL on CUDA,
    else gloo). What each one does is its :attr:`policy`."""

    NCCL_SYNC = "nccl_sync"
    NCCL_CADENCE = "nccl_cadence"
    CPU_SYNC = "cpu_sync"
    CPU_CADENCE = "cpu_cadence"
    CPU_ASYNC = "cpu_async"
    SOLO = "solo"

    @property
    def policy(self) -> ModePolicy:
        """The mode's entry in :data:`MODES`."""
        return MODES[self]


_RANK_SIDE = "flodl.runtime.rank.sync_modes."


@dataclass(frozen=True)
class ModePolicy:
    """One mode's declaration: its rank-side class and what the controller's side does."""

    mode: Mode
    summary: str  # how it averages, one line (the docs' table)
    rank_side: str  # dotted path of the class that averages on a rank (imported there only)
    alone: bool = False  # one rank trains, whatever the cluster (a baseline): nothing to agree on
    lock_step: bool = False  # one batch each, then average (classic DDP); else ElChe's windows
    via_controller: bool = False  # snapshots go to the controller, its average comes back
    gradient_sync: bool = False  # gradients all-reduced in backward while every member steps
    overshoot: bool = False  # ranks train on while the average round-trips (max_overshoot)
    consensus: bool = False  # an epoch ends on one set of weights: its last average, taken whole
    easgd: bool = False  # an average is blended in on arrival (easgd_alpha)
    shards_state: bool = False  # every rank steps the same gradient: memory_plan shard applies
    preset: Mapping[str, Any] = field(default_factory=dict)  # conf/elche/<mode>.yaml's changes

    @property
    def averages(self) -> bool:
        """The ranks agree on weights (all but ``solo``)."""
        return not self.alone

    @property
    def settles(self) -> bool:
        """The ranks average in a collective among themselves, so an epoch's last window is
        known to have held only once each rank says so (Settled)."""
        return self.averages and not self.via_controller

    @property
    def compress_refusal(self) -> str | None:
        """Why ``elche.compress`` does not apply to this mode; None where it does."""
        if self.alone:
            return "averages nothing"
        if self.gradient_sync:
            return "reduces gradients, not averages"
        return None


def _modes(*policies: ModePolicy) -> Mapping[Mode, ModePolicy]:
    table = {p.mode: p for p in policies}
    missing = [m.value for m in Mode if m not in table]
    if missing or len(table) != len(policies):
        raise RuntimeError(
            f"flodl.config.registries.modes: each Mode is declared once (missing: {missing})"
        )
    return MappingProxyType(table)


#: The registry: every :class:`Mode`, declared once.
MODES: Mapping[Mode, ModePolicy] = _modes(
    ModePolicy(
        Mode.NCCL_SYNC,
        "gradients all-reduced in buckets during backward (DDP's step), every step",
        _RANK_SIDE + "CollectiveSync",
        lock_step=True,
        gradient_sync=True,
        shards_state=True,
        preset={"anchor": 1},  # sync every step
    ),
    ModePolicy(
        Mode.NCCL_CADENCE,
        "parameters all-reduced among the ranks when each finished its ElChe window",
        _RANK_SIDE + "CollectiveSync",
    ),
    ModePolicy(
        Mode.CPU_SYNC,
        "parameter snapshots averaged by the controller, sent back, every step",
        _RANK_SIDE + "ControllerSync",
        lock_step=True,
        via_controller=True,
        preset={"anchor": 1},
    ),
    ModePolicy(
        Mode.CPU_CADENCE,
        "parameter snapshots averaged by the controller at the end of each ElChe window",
        _RANK_SIDE + "ControllerSync",
        via_controller=True,
    ),
    # cpu_async windows as nccl_cadence (docs/design/modes.md; the original's preset keeps anchor
    # 10): at anchor 1 its overlapped averaging never measures an overhead to grow the anchor
    # from, so it averaged every slow-rank batch, each arrival an EASGD pull toward a stale centre
    ModePolicy(
        Mode.CPU_ASYNC,
        "as cpu_cadence, training on while the average round-trips; blended in on arrival",
        _RANK_SIDE + "ControllerSync",
        via_controller=True,
        overshoot=True,
        consensus=True,
        easgd=True,
    ),
    ModePolicy(
        Mode.SOLO,
        "one device, no averaging (the baseline)",
        _RANK_SIDE + "SoloSync",
        alone=True,
    ),
)
