"""``cluster.memory_plan: shard`` on the rig: nccl_sync ranks over gloo whose optimizer state is
sharded in proportion to their free memory (flodl/runtime/sync/sharded_optimizer.py).

The model (``wide``, tests/integration/helpers.py) is ~1.1 M parameters (4.3 MiB): Adam's state
and its step's temporaries take ~13 MiB more, so under 20 MiB the plain state does not fit,
while a 40 MiB rank has room for most of the state and a 20 MiB one for a small share."""

from __future__ import annotations

import os
import re
import signal
from functools import partial

import pytest
import torch

from flodl.checkpoint.shards import load_shard
from flodl.runtime.controller.events import RunFailed
from flodl.runtime.controller.snapshots import ResumePoint
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.shard_cut import proportional_cut
from flodl.runtime.sync.shard_state import is_sharded, to_plain
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer
from tests.integration.helpers import optim_factory, plan_builder, rank_pid, wide

pytestmark = pytest.mark.slow

BIG, SMALL = 40.0, 20.0


def linear_decay(optimizer, total_steps):
    return torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=total_steps)


def _builder(tmp_path, name, memory_mb=(BIG, SMALL, SMALL), plan="auto", scheduler=None, **kw):
    n_train, epochs = kw.pop("n_train", 1536), kw.pop("epochs", 2)
    builder = plan_builder(tmp_path, name, "nccl_sync", memory_mb, plan, n_train, epochs)
    if scheduler is not None:
        builder = builder.scheduler(scheduler, interval="step")
    cfg = builder.build_config().with_(**kw)
    return builder.config(cfg)


def _run(builder, metrics_fn=None):
    if metrics_fn is not None:
        builder = builder.metrics_fn(metrics_fn)
    handle = builder.run()
    handle.join(timeout=300)
    return handle.result


def _plans(summary):
    return [p.split(": ", 1)[1].split(";")[0] for p in summary.memory_plans]


def _shares(summary):
    return [int(p.split("sharded (")[1].split(" %")[0]) for p in _plans(summary)]


def _within_budgets(summary, budgets):
    for t, budget in zip(summary.telemetry, budgets, strict=True):
        assert 0 < t["peak_mem_mb"] <= budget, (t["peak_mem_mb"], budget)


def test_auto_shards_where_the_small_ranks_cannot_hold_the_state(tmp_path):
    """3 ranks, 40/20/20 MiB: auto shards instead of offloading; the big rank takes most of
    the state, every rank stays within its budget, and the model learns. 50 batches an epoch:
    its tail window has a batch for two ranks only, and the third joins the step without one
    (a zero gradient in the all-reduce; it steps its pieces and broadcasts them, its per-step
    scheduler kept at the others' step)."""
    budgets = (BIG, SMALL, SMALL)
    result = _run(_builder(tmp_path, "auto", n_train=1600, scheduler=linear_decay))
    s = result.summary
    assert s.status == "ok" and result.coverage_exact
    plans = _plans(s)
    assert plans[0].startswith("batch 32, optimizer state sharded")
    assert all(p.startswith("batch 32, optimizer state sharded") for p in plans[1:]), plans
    shares = _shares(s)
    assert 98 <= sum(shares) <= 102 and shares[0] > 2 * shares[1] > 0, shares
    _within_budgets(s, budgets)
    assert s.eval_value > 0.5
    assert all(share > 0.1 for share in s.per_rank_sample_share)


def test_sharded_checkpoints_a_lost_holder_then_a_resume_on_fewer_ranks(tmp_path):
    """3 equal ranks shard (explicit): a third of the state each; a checkpoint each epoch;
    rank 2 is killed in epoch 2: the survivors take its intervals (its state lost, warned) and
    finish with exact coverage. The last bundle (written by the two survivors, sharded)
    resumes on 2 unequal ranks with a fresh cut, and every parameter's Adam state there goes
    on from the saved one."""
    stem = str(tmp_path / "ckpt" / "run")
    killed: list[int] = []

    def kill(m):
        if m.epoch == 1 and not killed:
            os.kill(rank_pid(2), signal.SIGKILL)
            killed.append(2)

    budgets = (BIG, BIG, BIG)
    builder = _builder(
        tmp_path, "lost", budgets, "shard", epochs=3, n_train=3072, save_path=stem,
        checkpoint_every=1,
    )  # fmt: skip
    result = _run(builder, kill)
    s = result.summary
    assert killed == [2] and s.status == "ok" and s.lost_ranks == [2]
    assert result.coverage_exact  # nothing the lost rank had planned went untrained
    assert _shares(s) == [33, 33, 33]
    _within_budgets(s, budgets)
    log = (tmp_path / "lost" / "rank_0.log").read_text()
    lost = re.search(r"rank 2 was lost with the optimizer state of (\d+) elements", log)
    assert lost is not None and int(lost.group(1)) > 350_000  # a third of ~1.1 M

    point = ResumePoint.load(stem)
    assert point.ranks == [0, 1] and point.meta.epoch == 3
    saved = [load_shard(point._location(f"rank{r}"))["optimizer"] for r in point.ranks]
    assert all(is_sharded(o) for o in saved)
    shapes = [p.shape for p in wide(torch.device("cpu")).parameters()]
    joined, fresh = to_plain(saved, shapes)
    assert fresh == 0  # the survivors' cut covered everything again
    _restores_the_saved_moments(point, joined)

    resumed = _builder(
        tmp_path, "resumed", memory_mb=(BIG, SMALL), plan="shard", epochs=4, n_train=3072,
        resume_from=stem, save_path=str(tmp_path / "ckpt2" / "run"),
    )  # fmt: skip
    r = _run(resumed)
    assert r.summary.status == "ok" and [m.epoch for m in r.epochs] == [4]
    assert all("optimizer state sharded" in p for p in _plans(r.summary))
    _within_budgets(r.summary, (BIG, SMALL))
    after = ResumePoint.load(str(tmp_path / "ckpt2" / "run"))
    again = [load_shard(after._location(f"rank{r}"))["optimizer"] for r in after.ranks]
    rejoined, fresh = to_plain(again, shapes)
    assert fresh == 0
    # One more epoch of Adam from the saved state: every parameter's step count went on from
    # the saved one by the same number of steps (the pieces the survivors took over from the
    # lost rank started from zero: their counts are lower, and stay so).
    deltas = {
        float(rejoined["state"][i]["step"]) - float(st["step"]) for i, st in joined["state"].items()
    }
    assert len(deltas) == 1 and deltas.pop() > 0


def _restores_the_saved_moments(point: ResumePoint, joined: dict) -> None:
    """What a rank of a 2-rank resume loads, from the files the controller names to it
    (``Restore.states``), under another cut (1:3): Adam's moments, element for element."""
    model = wide(torch.device("cpu"))
    state = FlatState(model, share_storage=True)
    optimizer = ShardedOptimizer(
        optim_factory(model.parameters()), optim_factory, state.params, state.shared
    )
    restore = point.restore_for(1)
    assert len(restore.states) == 2
    optimizer.assign(proportional_cut(optimizer.n, {0: 1, 1: 3}), 1)
    missing = optimizer.load_shards(
        [partial(lambda where: load_shard(where)["optimizer"], w) for w in restore.states]
    )
    assert missing == 0 and len(optimizer.pieces) >= 2  # it cuts through parameters
    for leaf, (i, lo, hi) in zip(optimizer._leaves, optimizer.pieces, strict=True):
        got = optimizer.inner.state[leaf]
        for key in ("exp_avg", "exp_avg_sq"):
            want = joined["state"][i][key].reshape(-1)[lo:hi]
            torch.testing.assert_close(got[key], want, rtol=0, atol=0)


def test_an_explicit_shard_the_cohort_cannot_hold_is_refused(tmp_path):
    """Two 20 MiB ranks have ~5 MiB free each for a ~12 MiB state: every rank reaches the same
    verdict from the same numbers, and the run fails naming them (auto would keep the state
    on the host instead)."""
    builder = _builder(tmp_path, "refused", memory_mb=(SMALL, SMALL), plan="shard")
    pattern = r"free device memory \(rank 0: .* in all\) cannot hold the optimizer state .*=offload"
    with pytest.raises(RunFailed, match=pattern):
        _run(builder)


def _steps(stem: str) -> dict[int, float]:
    """Each parameter's Adam step count in the bundle at ``stem`` (sharded or plain)."""
    point = ResumePoint.load(stem)
    saved = [load_shard(point._location(f"rank{r}"))["optimizer"] for r in point.ranks]
    if all(is_sharded(o) for o in saved):
        shapes = [p.shape for p in wide(torch.device("cpu")).parameters()]
        joined, fresh = to_plain(saved, shapes)
        assert fresh == 0
        saved = [joined]
    return {i: float(st["step"]) for i, st in saved[0]["state"].items()}


def test_a_sharded_bundle_resumes_sharded_and_unsharded_with_precision_and_accumulation(tmp_path):
    """2 ranks shard under bf16-mixed with 2 micro-batches a step and save; the bundle resumes
    on the same ranks (each re-assembles its pieces) and in an unsharded run (whole parameters
    joined from the pieces): in both, every parameter's Adam step count goes on from the saved
    one, so the state was the saved one, not a fresh start."""
    composed = dict(precision="bf16-mixed", accumulate_grad_batches=2)
    kw = dict(memory_mb=(BIG, SMALL), plan="shard", **composed)
    first = str(tmp_path / "first" / "run")
    s = _run(_builder(tmp_path, "first", epochs=1, save_path=first, **kw)).summary
    assert s.status == "ok" and all("optimizer state sharded" in p for p in _plans(s))
    _within_budgets(s, (BIG, SMALL))
    saved = _steps(first)
    per_epoch = set(saved.values())
    assert len(per_epoch) == 1 and per_epoch.pop() > 0

    again = str(tmp_path / "again" / "run")
    r = _run(_builder(tmp_path, "again", epochs=2, resume_from=first, save_path=again, **kw))
    assert r.summary.status == "ok" and [m.epoch for m in r.epochs] == [2]
    assert _steps(again) == {i: 2 * n for i, n in saved.items()}

    plain = str(tmp_path / "plain" / "run")
    unsharded = _builder(
        tmp_path, "plain", memory_mb=(BIG, BIG), plan="none", epochs=2, resume_from=first,
        save_path=plain, **composed,
    )  # fmt: skip
    r = _run(unsharded)
    assert r.summary.status == "ok" and not any("sharded" in p for p in _plans(r.summary))
    assert _steps(plain) == {i: 2 * n for i, n in saved.items()}


def test_auto_keeps_the_state_on_the_host_when_the_cohort_cannot_hold_it(tmp_path):
    """Two 20 MiB ranks cannot hold even shares of the state: auto falls back to offload."""
    s = _run(_builder(tmp_path, "fallback", memory_mb=(SMALL, SMALL), epochs=1)).summary
    assert s.status == "ok"
    assert _plans(s) == ["batch 32, optimizer state on host"] * 2
    _within_budgets(s, (SMALL, SMALL))


def test_sharded_ranks_train_the_same_weights_as_unsharded_ones(tmp_path):
    """nccl_sync steps every rank with the same all-reduced gradient: with the state sharded
    (each rank stepping its pieces, the owners broadcasting them) the run ends at the weights
    of the same run unsharded (48 batches over 3 ranks: no tail window where a rank has no
    batch, which nccl_sync averages by parameters unsharded)."""
    runs = {}
    for plan in ("shard", "none"):
        builder = _builder(tmp_path, plan, memory_mb=(BIG, BIG, BIG), plan=plan, epochs=1)
        result = _run(builder)
        assert result.summary.status == "ok"
        runs[plan] = result
    assert all("sharded" in p for p in _plans(runs["shard"].summary))
    assert not any("sharded" in p for p in _plans(runs["none"].summary))
    sharded, plain = runs["shard"].state.params, runs["none"].state.params
    assert sharded.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-5)


def test_a_rank_lost_before_the_group_forms_leaves_a_sharded_cohort_of_two(tmp_path, monkeypatch):
    """Sharding x a rank killed in its first moments (at ``join``, before the group forms) x
    checkpoints, 3 ranks under budgets: the survivors meet as two, cut the state between
    themselves alone, and train with exact coverage."""
    monkeypatch.setenv("FLODL_CHAOS", "2:join")
    budgets = (BIG, SMALL, SMALL)
    builder = _builder(
        tmp_path, "early", budgets, "shard", save_path=str(tmp_path / "ckpt" / "run"),
        checkpoint_every=1, max_failure=1,
    )  # fmt: skip
    s = (result := _run(builder)).summary
    assert s.status == "ok" and s.lost_ranks == [2] and result.coverage_exact
    shares = _shares(s)
    assert len(shares) == 2 and sum(shares) in (99, 100) and shares[0] > shares[1]
    for t, budget in zip(s.telemetry[:2], budgets[:2], strict=True):  # the survivors'
        assert 0 < t["peak_mem_mb"] <= budget, (t["peak_mem_mb"], budget)
