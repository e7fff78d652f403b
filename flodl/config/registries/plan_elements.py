"""The memory-plan elements, each declared once: what a rank may give up to fit its device.

An element is a :class:`PlanElement`: its name in ``cluster.memory_plan``, how a rank applies it
(its ``rank_side``, a function of :mod:`flodl.runtime.rank.memory_plan`), its footprint rule
(what it takes off the device, what it divides across the cohort), what it needs (a mode, an
elementwise optimizer), what it does not combine with, and its cost rank in the ``auto`` search.
The registry :data:`PLAN_ELEMENTS` is what the parser (:func:`parse_memory_plan`), the ``auto``
search (:func:`auto_candidates`), the launch-time arithmetic (flodl/preflight/footprint.py), the
rank and the guide's table (docs/guides/memory-plans.md) iterate; no module names an element
outside it. Adding one: docs/design/registries.md. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import combinations
from types import MappingProxyType

#: The parts of a rank's training state a footprint rule speaks of.
PARTS = ("params", "grads", "state")  # parameters, their gradients, the optimizer's state


@dataclass(frozen=True)
class PlanElement:
    """One element of a memory plan."""

    name: str
    words: str  # how the rank's announcement names it ("optimizer state on host")
    summary: str  # what it does and costs (the guide's table)
    rank_side: str  # dotted path of fn(memory, rank, plan, cohort) applying it on a rank
    cost: int  # the auto search tries cheaper plans first (a plan's cost: its elements' sum)
    to_host: frozenset[str] = frozenset()  # parts it keeps in host memory instead
    divides: frozenset[str] = frozenset()  # parts it divides across the cohort (a cohort cut)
    recomputes: bool = False  # the step runs forward again in backward (calibration times it)
    holds_model: bool = False  # it changes how the model is held (wraps the model and its step)
    needs_mode: str | None = (
        None  # a ModePolicy flag its mode must have (flodl/config/registries/modes.py)
    )
    elementwise_optimizer: bool = False  # it steps pieces of parameters on their own
    excludes: Mapping[str, str] = field(default_factory=dict)  # element -> why they do not mix

    @property
    def cohort(self) -> bool:
        """The cohort cuts it: each rank's share follows the others' free memory."""
        return bool(self.divides)

    @property
    def state_off_device(self) -> bool:
        """The optimizer's state is not (all) on this rank's device: the probe steps without it."""
        return "state" in self.to_host or "state" in self.divides


def _elements(*elements: PlanElement) -> Mapping[str, PlanElement]:
    table = {e.name: e for e in elements}
    for e in elements:
        for other in e.excludes:
            if other not in table:
                raise RuntimeError(f"plan element {e.name} excludes unknown {other}")
    return MappingProxyType(table)


_RANK_SIDE = "flodl.runtime.rank.memory_plan."

#: The registry, in the order a plan lists its elements and a rank applies them.
PLAN_ELEMENTS: Mapping[str, PlanElement] = _elements(
    PlanElement(
        "recompute",
        "activation checkpointing",
        "activations recomputed in backward: one block's kept instead of all, for about one "
        "more forward pass",
        _RANK_SIDE + "apply_recompute",
        cost=1,
        recomputes=True,
    ),
    PlanElement(
        "offload",
        "optimizer state on host",
        "the optimizer's state and step on the host: host traffic and a host step each step",
        _RANK_SIDE + "apply_offload",
        cost=4,
        to_host=frozenset({"state"}),
    ),
    PlanElement(
        "shard",
        "optimizer state sharded",
        "the optimizer's state split across the ranks by free memory (ZeRO-1, unevenly): a "
        "broadcast of each rank's updated share per step",
        _RANK_SIDE + "apply_shard",
        cost=2,
        divides=frozenset({"state"}),
        needs_mode="shards_state",
        elementwise_optimizer=True,
        excludes={
            "offload": "sharded state on the host is not built); use shard (a share of the "
            "state on each device) or offload (all of it on the host"
        },
    ),
)


def _excluded(names: Iterable[str]) -> tuple[str, str, str] | None:
    """The first pair of ``names`` that does not combine, with the reason; None if all do."""
    chosen = list(names)
    for name in chosen:
        for other, why in PLAN_ELEMENTS[name].excludes.items():
            if other in chosen:
                return name, other, why
    return None


def parse_memory_plan(plan: str) -> tuple[str, ...] | None:
    """``auto`` -> None (probed); ``none`` -> (); ``recompute+offload`` -> its elements, in the
    registry's order."""
    text = plan.strip().lower()
    if text == "auto":
        return None
    if text == "none":
        return ()
    parts = tuple(p.strip() for p in text.split("+"))
    unknown = [p for p in parts if p not in PLAN_ELEMENTS]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(
            f"memory plan {plan!r}: use auto, none, or a '+'-joined set of "
            f"{', '.join(PLAN_ELEMENTS)} (e.g. recompute+offload)"
        )
    clash = _excluded(parts)
    if clash is not None:
        name, other, why = clash
        raise ValueError(f"memory plan {plan!r}: {name} and {other} do not combine ({why})")
    return tuple(e for e in PLAN_ELEMENTS if e in parts)


def auto_candidates(cohort: bool) -> list[tuple[str, ...]]:
    """The plans ``auto`` tries at the rank's own batch, cheapest first: every combination of
    elements that combine (``cohort``: the cohort may cut its state, so the cohort elements
    are tried too; an element that holds the model is never chosen automatically)."""
    names = [
        e.name for e in PLAN_ELEMENTS.values() if not e.holds_model and (cohort or not e.cohort)
    ]
    plans = [
        combo
        for k in range(len(names) + 1)
        for combo in combinations(names, k)
        if _excluded(combo) is None
    ]
    return sorted(plans, key=lambda combo: sum(PLAN_ELEMENTS[e].cost for e in combo))


def fallback_plan() -> tuple[str, ...]:
    """What ``auto`` tries at smaller batches (the rig): the most a rank can give up alone,
    every element that needs no cohort and combines with the others."""
    return max(auto_candidates(cohort=False), key=lambda c: sum(PLAN_ELEMENTS[e].cost for e in c))


def with_elements(plan: Iterable[str], add: Iterable[str] = (), drop: Iterable[str] = ()) -> tuple:
    """``plan`` with ``add`` and without ``drop``, in the registry's order."""
    chosen = (set(plan) | set(add)) - set(drop)
    return tuple(e for e in PLAN_ELEMENTS if e in chosen)


def words(plan: Iterable[str]) -> str:
    """``activation checkpointing and optimizer state on host``: how a plan reads."""
    said = [PLAN_ELEMENTS[e].words for e in plan]
    return " and ".join([", ".join(said[:-1]), said[-1]]) if len(said) > 1 else "".join(said)


def elements_of(plan: Iterable[str]) -> list[PlanElement]:
    return [PLAN_ELEMENTS[e] for e in plan]


def cutting_state() -> tuple[str, ...]:
    """The elements that divide the optimizer's state, and only it, across the cohort
    (``shard``): what a cohort's cut of the state gives each rank."""
    return tuple(e.name for e in PLAN_ELEMENTS.values() if e.divides == {"state"})


def hosting_state() -> tuple[str, ...]:
    """The elements that keep the optimizer's state on the host (``offload``): where a rank
    that cannot hold its share of a cut keeps it."""
    return tuple(e.name for e in PLAN_ELEMENTS.values() if "state" in e.to_host)
