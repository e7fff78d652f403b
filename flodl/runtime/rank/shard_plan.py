"""``cluster.memory_plan: shard`` on a rank: whether the cohort may shard, and the cut it agrees on.

A partition involves every rank, so it is the cohort's decision, taken once the group has met
(:meth:`flodl.runtime.rank.loop.RankLoop._meet`): each rank adds what it knows to one
all-reduce (whether its plan asks for ``shard``, the device memory it has free for optimizer
state, the state's cost on it), and every rank then computes the same verdict from the same
numbers (:func:`flodl.runtime.sync.shard_cut.decide`). If any rank asks for ``shard``, all
shard: a rank whose plan did not ask takes its proportional share too (a rank that offloads
takes none). An ``auto`` plan whose share the cohort cannot hold falls back to ``offload``; an
explicit ``shard`` the cohort cannot hold fails, naming the numbers.

On a lost rank (:func:`recut`) its intervals go to the survivors, their optimizer state starts
from zero, and the rank is named with the bytes of state lost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from flodl.config.registries.plan_elements import (
    cutting_state,
    hosting_state,
    parse_memory_plan,
    with_elements,
)
from flodl.runtime.rank.setup import MemoryPlan
from flodl.runtime.sync import shard_cut
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer, elementwise
from flodl.runtime.wire.job_spec import JobSpec

log = logging.getLogger(__name__)


class MemoryPlanError(RuntimeError):
    """No plan fits this rank's device (or, for ``shard``, the cohort's)."""


def shardable(spec: JobSpec, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this cohort may shard: nccl_sync over more than one rank, and a plan that asks
    for ``shard``, or ``auto`` where budgets exist (the rig's memory_mb, CUDA) and the
    optimizer is elementwise. Every rank computes the same answer from the config."""
    cfg = spec.config
    if not cfg.elche.mode.policy.shards_state or spec.world_size < 2:
        return False
    cluster = cfg.cluster
    if cluster.plans_cohort():
        if not elementwise(optimizer):
            raise ValueError(
                f"cluster.memory_plan={cluster.memory_plan}: shard steps each rank's pieces of "
                "the parameters on their own, which needs an elementwise optimizer (SGD, Adam, "
                f"AdamW, RMSprop, ...); {type(optimizer).__name__} is not one. Use "
                "offload"
            )
        return True
    budgets = cluster.memory_mb is not None or spec.backend == "nccl"
    autos = any(
        parse_memory_plan(cluster.rank_memory_plan(r)) is None for r in range(spec.world_size)
    )
    return budgets and autos and elementwise(optimizer)


def wrap(
    optimizer: torch.optim.Optimizer,
    optim_factory: Callable[..., torch.optim.Optimizer],
    state: FlatState,
) -> ShardedOptimizer:
    """The rank's optimizer inside a :class:`ShardedOptimizer`: whole until the cohort cuts."""
    return ShardedOptimizer(optimizer, optim_factory, state.params, state.shared)


def _demand(plan: MemoryPlan, auto: bool) -> list[float]:
    offloads = plan.state_on_host
    free = 0 if offloads else plan.free_bytes
    return [
        1.0,  # present
        float(plan.cohort),
        float(auto),
        -1.0 if free is None else float(max(free, 0)),
        float(plan.state_bytes),
    ]


def agree(
    optimizer: torch.optim.Optimizer,
    plan: MemoryPlan,
    rank: int,
    spec: JobSpec,
    together: Callable[[torch.Tensor], None],
    on_host: Callable[[], torch.optim.Optimizer],
) -> MemoryPlan:
    """Gather every member's demand (``together``: a start-up collective; a lost member fails
    it as ``CohortBroke``), decide, and apply the verdict to this rank's ``optimizer``
    (``on_host``: the optimizer on the host a rank falls back to); the rank's plan after it."""
    if not isinstance(optimizer, ShardedOptimizer):
        return plan
    auto = parse_memory_plan(spec.config.cluster.rank_memory_plan(rank)) is None
    table = torch.zeros(spec.world_size, 5, dtype=torch.float64)
    table[rank] = torch.tensor(_demand(plan, auto), dtype=torch.float64)
    together(table)
    demands = [
        shard_cut.Demand(
            rank=r,
            wants=bool(row[1]),
            auto=bool(row[2]),
            free=None if row[3] < 0 else int(row[3]),
            state=int(row[4]),
        )
        for r, row in enumerate(table.tolist())
        if row[0] > 0
    ]
    decision = shard_cut.decide(demands, optimizer.n)
    if decision.error:
        raise MemoryPlanError(decision.error)
    if decision.sharded:
        optimizer.free = {d.rank: d.free for d in demands}
        optimizer.state_cost = max(d.state for d in demands)
        optimizer.assign(decision.cut, rank)
        share = shard_cut.owned(decision.cut, rank) / max(optimizer.n, 1)
        elements = with_elements(plan.elements, add=cutting_state(), drop=hosting_state())
        return dataclasses.replace(plan, elements=elements, share=share)
    if rank in decision.fallback:  # auto: the cohort cannot hold it; on the host
        log.info(
            "rank %d: the cohort's free memory cannot hold the sharded optimizer state; "
            "keeping it on the host (offload)",
            rank,
        )
        optimizer.replace_whole(on_host())
        elements = with_elements(plan.elements, add=hosting_state(), drop=cutting_state())
        return dataclasses.replace(plan, elements=elements)
    return plan


def recut(optimizer: torch.optim.Optimizer, rank: int, members: tuple[int, ...]) -> float | None:
    """A new membership: the lost members' intervals go to the survivors (in proportion to
    their free memory); their optimizer state is lost and starts from zero (warned). The share
    of the state this rank now holds; None when nothing was cut again."""
    if not isinstance(optimizer, ShardedOptimizer) or not optimizer.sharded:
        return None
    lost = shard_cut.lost_intervals(optimizer.cut, members)
    if not lost:
        return None
    per_element = optimizer.state_bytes() / max(shard_cut.owned(optimizer.cut, rank), 1)
    new = shard_cut.reassign(optimizer.cut, members, getattr(optimizer, "free", {}))
    optimizer.assign(new, rank)
    for lost_rank in sorted({r for r, _ in lost}):
        elements = sum(hi - lo for r, (lo, hi) in lost if r == lost_rank)
        log.warning(
            "rank %d: rank %d was lost with the optimizer state of %d elements (about %.1f "
            "MiB); its intervals go to ranks %s and their state starts from zero",
            rank,
            lost_rank,
            elements,
            elements * per_element / 2**20,
            ", ".join(map(str, members)),
        )
    share = shard_cut.owned(new, rank) / max(optimizer.n, 1)
    free = optimizer.free.get(rank)
    if free is not None and share * optimizer.state_cost > free:
        log.warning(
            "rank %d: its share of the optimizer state is now %.0f %% (%.1f MiB), more than "
            "the %.1f MiB it has free: it may run out of memory (memory_plan=offload keeps the "
            "state on the host)",
            rank,
            100 * share,
            share * optimizer.state_cost / 2**20,
            free / 2**20,
        )
    return share
