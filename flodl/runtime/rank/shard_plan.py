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
from typing import Any

import torch

from flodl.config import Mode
from flodl.config.cluster import parse_memory_plan
from flodl.runtime.sync import shard_cut
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer, elementwise

log = logging.getLogger(__name__)


class MemoryPlanError(RuntimeError):
    """No plan fits this rank's device (or, for ``shard``, the cohort's)."""


def shardable(worker: Any) -> bool:
    """Whether this cohort may shard: nccl_sync over more than one rank, and a plan that asks
    for ``shard``, or ``auto`` where budgets exist (the rig's memory_mb, CUDA) and the
    optimizer is elementwise. Every rank computes the same answer from the config."""
    cfg, spec = worker.cfg, worker.spec
    if cfg.elche.mode is not Mode.NCCL_SYNC or spec.world_size < 2:
        return False
    cluster = cfg.cluster
    if cluster.plans_shard():
        if not elementwise(worker.optimizer):
            raise ValueError(
                f"cluster.memory_plan={cluster.memory_plan}: shard steps each rank's pieces of "
                "the parameters on their own, which needs an elementwise optimizer (SGD, Adam, "
                f"AdamW, RMSprop, ...); {type(worker.optimizer).__name__} is not one. Use "
                "offload"
            )
        return True
    budgets = cluster.memory_mb is not None or spec.backend == "nccl"
    autos = any(
        parse_memory_plan(cluster.rank_memory_plan(r)) is None for r in range(spec.world_size)
    )
    return budgets and autos and elementwise(worker.optimizer)


def wrap(worker: Any) -> ShardedOptimizer:
    """The rank's optimizer inside a :class:`ShardedOptimizer`: whole until the cohort cuts."""
    return ShardedOptimizer(
        worker.optimizer, worker.spec.optim_factory, worker.state.params, worker.state.shared
    )


def _demand(worker: Any) -> list[float]:
    plan = worker.memory_plan
    offloads = "offload" in plan.elements
    auto = parse_memory_plan(worker.cfg.cluster.rank_memory_plan(worker.rank)) is None
    free = 0 if offloads else plan.free_bytes
    return [
        1.0,  # present
        float("shard" in plan.elements),
        float(auto),
        -1.0 if free is None else float(max(free, 0)),
        float(plan.state_bytes),
    ]


def agree(worker: Any) -> None:
    """Gather every member's demand (a start-up collective: a lost member fails it as
    ``_CohortBroke``), decide, and apply the verdict to this rank's optimizer and plan."""
    optimizer = worker.optimizer
    if not isinstance(optimizer, ShardedOptimizer):
        return
    table = torch.zeros(worker.spec.world_size, 5, dtype=torch.float64)
    table[worker.rank] = torch.tensor(_demand(worker), dtype=torch.float64)
    worker._together(table)
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
    plan = worker.memory_plan
    if decision.sharded:
        optimizer.free = {d.rank: d.free for d in demands}
        optimizer.state_cost = max(d.state for d in demands)
        optimizer.assign(decision.cut, worker.rank)
        share = shard_cut.owned(decision.cut, worker.rank) / max(optimizer.n, 1)
        elements = tuple(e for e in plan.elements if e not in ("offload", "shard"))
        worker.memory_plan = dataclasses.replace(plan, elements=(*elements, "shard"), share=share)
    elif worker.rank in decision.fallback:  # auto: the cohort cannot hold it; on the host
        log.info(
            "rank %d: the cohort's free memory cannot hold the sharded optimizer state; "
            "keeping it on the host (offload)",
            worker.rank,
        )
        optimizer.replace_whole(worker.device_memory.host_optimizer(worker))
        elements = tuple(e for e in plan.elements if e != "shard")
        worker.memory_plan = dataclasses.replace(plan, elements=(*elements, "offload"))


def recut(worker: Any, members: tuple[int, ...]) -> None:
    """A new membership: the lost members' intervals go to the survivors (in proportion to
    their free memory); their optimizer state is lost and starts from zero (warned)."""
    optimizer = getattr(worker, "optimizer", None)
    if not isinstance(optimizer, ShardedOptimizer) or not optimizer.sharded:
        return
    lost = shard_cut.lost_intervals(optimizer.cut, members)
    if not lost:
        return
    per_element = optimizer.state_bytes() / max(shard_cut.owned(optimizer.cut, worker.rank), 1)
    new = shard_cut.reassign(optimizer.cut, members, getattr(optimizer, "free", {}))
    optimizer.assign(new, worker.rank)
    for rank in sorted({r for r, _ in lost}):
        elements = sum(hi - lo for r, (lo, hi) in lost if r == rank)
        log.warning(
            "rank %d: rank %d was lost with the optimizer state of %d elements (about %.1f "
            "MiB); its intervals go to ranks %s and their state starts from zero",
            worker.rank,
            rank,
            elements,
            elements * per_element / 2**20,
            ", ".join(map(str, members)),
        )
    share = shard_cut.owned(new, worker.rank) / max(optimizer.n, 1)
    worker.memory_plan = dataclasses.replace(worker.memory_plan, share=share)
    free = optimizer.free.get(worker.rank)
    if free is not None and share * optimizer.state_cost > free:
        log.warning(
            "rank %d: its share of the optimizer state is now %.0f %% (%.1f MiB), more than "
            "the %.1f MiB it has free: it may run out of memory (memory_plan=offload keeps the "
            "state on the host)",
            worker.rank,
            100 * share,
            share * optimizer.state_cost / 2**20,
            free / 2**20,
        )
