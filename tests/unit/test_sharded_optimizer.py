"""The sharded optimizer (flodl/runtime/sync/sharded_optimizer.py) in one process: "ranks" are
model copies, each stepping its own pieces; the exchange is played by copying each owner's
intervals to the others. Sharded steps must equal the plain optimizer's, and the state must
re-cut (another cut, another world size, a plain optimizer) without loss."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.shard_cut import proportional_cut, reassign
from flodl.runtime.sync.shard_state import is_sharded, to_plain
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer, elementwise

FACTORIES = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, weight_decay=1e-3),
    "adamw_groups": lambda ps: _two_groups(ps),
}


def _two_groups(ps):
    ps = list(ps)
    return torch.optim.AdamW(
        [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


class _Rank:
    """One simulated rank: its model (parameters in one flat buffer) and sharded optimizer."""

    def __init__(self, factory) -> None:
        self.model = _model()
        self.state = FlatState(self.model, share_storage=True)
        plain = factory(self.model.parameters())
        self.opt = ShardedOptimizer(plain, factory, self.state.params, self.state.shared)


def _cohort(factory, free: dict[int, int]) -> tuple[dict[int, _Rank], dict]:
    ranks = {r: _Rank(factory) for r in free}
    cut = proportional_cut(ranks[min(ranks)].opt.n, free)
    for r, rank in ranks.items():
        rank.opt.assign(cut, r)
    return ranks, cut


def _step(ranks: dict[int, _Rank], cut: dict, step: int) -> None:
    for rank in ranks.values():
        _grads(rank.model, step)
        rank.opt.step()
    for owner, intervals in cut.items():  # the exchange: each owner's intervals to the others
        for lo, hi in intervals:
            for rank in ranks.values():
                rank.state.shared()[lo:hi] = ranks[owner].state.shared()[lo:hi]


@pytest.mark.parametrize("name", list(FACTORIES))
def test_sharded_steps_equal_the_plain_optimizers(name):
    factory = FACTORIES[name]
    reference = _model()
    plain = factory(reference.parameters())
    ranks, cut = _cohort(factory, {0: 300, 1: 100, 2: 50})  # uneven, cutting through tensors
    for step in range(5):
        _grads(reference, step)
        plain.step()
        _step(ranks, cut, step)
    for rank in ranks.values():
        for a, b in zip(rank.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_only_the_owned_share_of_the_state_is_held():
    ranks, cut = _cohort(FACTORIES["adam"], {0: 300, 1: 100})
    _step(ranks, cut, 0)
    n = ranks[0].opt.n
    held = {r: rank.opt.state_bytes() for r, rank in ranks.items()}
    # Adam: two float32 moments per owned element (plus a step count per piece)
    for r in ranks:
        owned = sum(hi - lo for lo, hi in cut[r])
        assert 8 * owned <= held[r] <= 8 * owned + 4 * 8
    assert sum(hi - lo for ivs in cut.values() for lo, hi in ivs) == n
    assert held[0] > 2.5 * held[1]  # 3:1 in free memory


def test_the_state_recuts_to_another_world_size_and_to_the_plain_format():
    """3 ranks save their shards; 2 ranks with another cut load them: Adam's moments are the
    saved ones, element for element; and a plain optimizer loads them joined."""
    factory = FACTORIES["adamw_groups"]
    ranks, cut = _cohort(factory, {0: 300, 1: 100, 2: 50})
    for step in range(3):
        _step(ranks, cut, step)
    shards = [copy.deepcopy(rank.opt.state_dict()) for rank in ranks.values()]
    assert all(is_sharded(s) for s in shards)
    reference = _model()
    plain = factory(reference.parameters())
    for step in range(3):
        _grads(reference, step)
        plain.step()
    expected = plain.state_dict()["state"]

    two, _ = _cohort(factory, {0: 10, 1: 90})
    for rank in two.values():
        assert rank.opt.load_shards(shards) == 0
        for leaf, (i, lo, hi) in zip(rank.opt._leaves, rank.opt.pieces, strict=True):
            got = rank.opt.inner.state[leaf]
            want = expected[i]["exp_avg"].reshape(-1)[lo:hi]
            torch.testing.assert_close(got["exp_avg"], want)
            assert float(got["step"]) == 3.0
    joined, fresh = to_plain(shards, [p.shape for p in reference.parameters()])
    assert fresh == 0
    for i, st in expected.items():
        torch.testing.assert_close(joined["state"][i]["exp_avg_sq"], st["exp_avg_sq"])
    assert [g["lr"] for g in joined["param_groups"]] == [1e-2, 3e-3]


def test_a_shard_missing_from_the_bundle_starts_afresh_and_is_counted():
    ranks, cut = _cohort(FACTORIES["adam"], {0: 100, 1: 100})
    _step(ranks, cut, 0)
    only_rank0 = [ranks[0].opt.state_dict()]
    two, _ = _cohort(FACTORIES["adam"], {0: 100, 1: 100})
    assert two[0].opt.load_shards(only_rank0) == 0
    assert two[1].opt.load_shards(only_rank0) == sum(hi - lo for lo, hi in cut[1])


def test_a_lost_ranks_intervals_go_to_the_survivors_who_keep_their_own_state():
    ranks, cut = _cohort(FACTORIES["adam"], {0: 300, 1: 100, 2: 100})
    _step(ranks, cut, 0)
    before = {r: ranks[r].opt.state_bytes() for r in (0, 1)}
    new = reassign(cut, [0, 1], {0: 300, 1: 100, 2: 100})
    for r in (0, 1):
        fresh = ranks[r].opt.assign(new, r)
        assert fresh == sum(hi - lo for lo, hi in new[r]) - sum(hi - lo for lo, hi in cut[r])
        assert ranks[r].opt.state_bytes() == before[r]  # kept; the new pieces have none yet
    survivors = {r: ranks[r] for r in (0, 1)}
    _step(survivors, new, 1)
    torch.testing.assert_close(survivors[0].state.shared(), survivors[1].state.shared())


def test_whole_until_cut_and_elementwise_check():
    rank = _Rank(FACTORIES["adam"])
    _grads(rank.model, 0)
    rank.opt.step()  # no cut yet: the plain optimizer steps everything
    assert not rank.opt.sharded and len(rank.opt.state) == 4
    assert elementwise(torch.optim.Adam([nn.Parameter(torch.zeros(1))]))
    assert not elementwise(torch.optim.LBFGS([nn.Parameter(torch.zeros(1))]))


def test_a_scheduler_and_the_lr_scaling_reach_the_pieces():
    """Schedulers and the LR scaling change the outer groups (the plain optimizer's); each step
    hands their hyper-parameters to the pieces."""
    ranks, cut = _cohort(FACTORIES["adamw_groups"], {0: 1, 1: 1})
    opt = ranks[1].opt
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for group in opt.param_groups:
        group["lr"] *= 2  # as the LR scaling does
    _step(ranks, cut, 0)
    scheduler.step()
    _step(ranks, cut, 1)
    assert [g["lr"] for g in opt.inner.param_groups] == [1e-2, 3e-3]  # x2, then x0.5
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-3]


def test_the_exchange_gathers_and_scatters_where_parameters_are_not_one_buffer():
    """Without the flat buffer (mixed dtypes, say) an interval travels as a gathered copy."""
    model = _model()
    factory = FACTORIES["adam"]
    opt = ShardedOptimizer(factory(model.parameters()), factory, list(model.parameters()))
    lo, hi = 30, 61  # across the first weight, its bias and the second weight
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(opt._gather(lo, hi), flat[lo:hi])
    opt._scatter(lo, hi, torch.arange(hi - lo, dtype=torch.float32))
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(after[lo:hi], torch.arange(hi - lo, dtype=torch.float32))
    torch.testing.assert_close(after[:lo], flat[:lo])
    torch.testing.assert_close(after[hi:], flat[hi:])


def test_a_plain_state_is_cut_into_the_pieces_of_a_sharded_rank():
    """A bundle saved without the plan (or with offload: the same format) resumes sharded:
    each rank cuts its pieces from the plain state."""
    factory = FACTORIES["adam"]
    reference = _model()
    plain = factory(reference.parameters())
    for step in range(2):
        _grads(reference, step)
        plain.step()
    saved = copy.deepcopy(plain.state_dict())
    ranks, _ = _cohort(factory, {0: 2, 1: 1})
    for rank in ranks.values():
        rank.opt.load_state_dict(saved)
        for leaf, (i, lo, hi) in zip(rank.opt._leaves, rank.opt.pieces, strict=True):
            want = saved["state"][i]["exp_avg_sq"].reshape(-1)[lo:hi]
            torch.testing.assert_close(rank.opt.inner.state[leaf]["exp_avg_sq"], want)
