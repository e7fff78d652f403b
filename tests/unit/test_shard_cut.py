"""Who owns which part of the optimizer state (flodl/runtime/sync/shard_cut.py), and the
config and launch checks of ``memory_plan: shard``: pure, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl.config import ClusterConfig, ConfigError, ElCheConfig, TrainerConfig
from flodl.preflight.footprint import check_memory
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.shard_cut import Demand, decide, owned, proportional_cut, reassign
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer

MiB = 1 << 20


def _covers(cut, n):
    """Every element of [0, n) owned exactly once."""
    marks = torch.zeros(n, dtype=torch.int64)
    for intervals in cut.values():
        for lo, hi in intervals:
            marks[lo:hi] += 1
    return bool((marks == 1).all())


def test_the_cut_is_proportional_to_free_memory_and_covers_everything():
    cut = proportional_cut(1000, {0: 30 * MiB, 1: 10 * MiB, 2: 10 * MiB})
    assert cut == {0: [(0, 600)], 1: [(600, 800)], 2: [(800, 1000)]}
    odd = proportional_cut(12_500_003, {0: 7, 1: 3, 2: 5, 3: 1})
    assert _covers(odd, 12_500_003)
    sizes = [owned(odd, r) for r in range(4)]
    assert [round(16 * s / 12_500_003) for s in sizes] == [7, 3, 5, 1]


def test_ranks_without_a_budget_or_free_memory():
    # not counted (no budget): as roomy as the roomiest counted one; nothing free: no share
    assert proportional_cut(90, {0: 20, 1: None, 2: 0}) == {0: [(0, 45)], 1: [(45, 90)], 2: []}
    assert proportional_cut(90, {0: None, 1: None, 2: None}) == {
        0: [(0, 30)],
        1: [(30, 60)],
        2: [(60, 90)],
    }


def test_a_lost_ranks_intervals_are_split_among_the_survivors_in_proportion():
    free = {0: 30, 1: 10, 2: 20}
    cut = proportional_cut(600, free)
    new = reassign(cut, [0, 1], free)
    assert new[0][0] == cut[0][0] and new[1][0] == cut[1][0]  # their own, kept whole
    assert _covers(new, 600) and 2 not in new
    lost = cut[2][0][1] - cut[2][0][0]
    assert owned(new, 0) - owned(cut, 0) == 3 * lost // 4  # 30:10


def test_pieces_cut_through_parameters_and_keep_their_groups():
    """One interval across three tensors of two parameter groups: each piece sits in the
    group of its parameter, with that group's hyper-parameters."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    state = FlatState(model, share_storage=True)
    ps = list(model.parameters())
    plain = torch.optim.SGD(
        [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.01, "momentum": 0.9}]
    )
    opt = ShardedOptimizer(plain, lambda p: torch.optim.SGD(p, lr=1.0), state.params)
    assert opt.n == 20 + 5 + 15 + 3
    opt.assign({0: [(0, 22)], 1: [(22, 43)]}, 1)
    assert opt.pieces == [(1, 2, 5), (2, 0, 15), (3, 0, 3)]
    inner = opt.inner
    assert [len(g["params"]) for g in inner.param_groups] == [1, 2]
    assert [(g["lr"], g["momentum"]) for g in inner.param_groups] == [(0.1, 0), (0.01, 0.9)]
    assert inner.param_groups[0]["params"][0].data_ptr() == ps[1].data_ptr() + 2 * 4


def _demand(rank, free, state=12 * MiB, wants=True, auto=True):
    return Demand(rank=rank, wants=wants, auto=auto, free=free, state=state)


def test_the_cohort_shards_only_when_every_share_fits():
    fits = decide([_demand(0, 20 * MiB, wants=False), _demand(1, 4 * MiB)], 1000)
    assert fits.sharded and owned(fits.cut, 0) == 833
    short = [_demand(0, 5 * MiB), _demand(1, 4 * MiB)]
    assert decide(short, 1000).fallback == (0, 1)  # auto: both keep their state on the host
    explicit = decide([_demand(0, 5 * MiB, auto=False), _demand(1, 4 * MiB)], 1000)
    assert not explicit.sharded and "9.0 MiB in all" in explicit.error
    assert "cannot hold the optimizer state (12.0 MiB)" in explicit.error
    assert not decide([_demand(0, 5 * MiB, wants=False)], 1000).sharded  # nobody asks


def test_shard_is_refused_outside_nccl_sync_and_beside_offload():
    cluster = ClusterConfig(kind="cpu_rig", memory_plan=["shard", "none"])
    with pytest.raises(ValueError, match=r"only elche\.mode=nccl_sync does"):
        TrainerConfig(cluster=cluster, elche=ElCheConfig(mode="nccl_cadence"))
    TrainerConfig(cluster=cluster, elche=ElCheConfig(mode="nccl_sync"))
    with pytest.raises(ValueError, match="shard and offload do not combine"):
        ClusterConfig(kind="cpu_rig", memory_plan="offload+shard")


class _Spec:
    def __init__(self, memory_mb, plan):
        self.config = TrainerConfig(
            cluster=ClusterConfig(kind="cpu_rig", ranks=2, memory_mb=memory_mb, memory_plan=plan),
            elche=ElCheConfig(mode="nccl_sync"),
        )
        self.model_factory = lambda device: nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8))
        self.optim_factory = lambda ps: torch.optim.Adam(ps, lr=1e-3)


def test_an_explicit_shard_the_cohort_cannot_hold_is_refused_at_launch():
    # ~4.0 MiB of parameters, as much of gradients, ~8.1 MiB of Adam state
    with pytest.raises(ConfigError, match=r"does not fit .* 3\.9 MiB in all\) even sharded"):
        check_memory(_Spec([10, 10], "shard"), 2)
    check_memory(_Spec([16, 10], "shard"), 2)  # 8 + 2 MiB beyond: the ranks decide
    check_memory(_Spec([10, 10], "auto"), 2)  # auto: falls back to offload
