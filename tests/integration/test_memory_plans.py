"""Memory plans on the rig (``cluster.memory_plan``): real ranks over gloo under simulated device
budgets (``cluster.memory_mb``) in which the plain training state does not fit the small ranks.

The model (``wide``, tests/integration/helpers.py) is all parameters: ~1.1 M (4.3 MiB), so
Adam's state is 8.6 MiB and the plain state with averaging's temporaries ~22 MiB, while
activations at batch 32 are ~0.4 MiB.
Under 20 MiB the plain state does not fit and the optimizer state on the host does."""

from __future__ import annotations

import os
import signal

import pytest

from flodl import ConfigError
from tests.integration.helpers import plan_builder, rank_pid

pytestmark = pytest.mark.slow

BIG, SMALL = 40.0, 20.0


def _builder(tmp_path, name, mode="nccl_cadence", memory_mb=(BIG, SMALL), plan="auto", **kw):
    n_train, epochs = kw.pop("n_train", 1536), kw.pop("epochs", 2)
    builder = plan_builder(tmp_path, name, mode, memory_mb, plan, n_train, epochs)
    return builder, kw


def _run(tmp_path, name, **kw):
    builder, rest = _builder(tmp_path, name, **kw)
    cfg = builder.build_config().with_(**rest)
    handle = builder.config(cfg).run()
    handle.join(timeout=300)
    return handle.result


def _plans(summary):
    return [p.split(": ", 1)[1].split(";")[0] for p in summary.memory_plans]


def _within_budgets(summary, budgets):
    for t, budget in zip(summary.telemetry, budgets, strict=True):
        assert 0 < t["peak_mem_mb"] <= budget, (t["peak_mem_mb"], budget)


def test_three_ranks_train_where_the_small_ones_cannot_hold_the_state(tmp_path):
    budgets = (BIG, SMALL, SMALL)
    result = _run(tmp_path, "auto3", memory_mb=budgets)
    s = result.summary
    assert s.status == "ok" and result.coverage_exact
    assert _plans(s) == [
        "batch 32, no plan needed",
        "batch 32, optimizer state on host",
        "batch 32, optimizer state on host",
    ]
    _within_budgets(s, budgets)
    assert s.eval_value > 0.5  # 4 classes: it learned, with every rank contributing
    assert all(share > 0.1 for share in s.per_rank_sample_share)


def test_without_a_plan_the_small_rank_runs_out_of_memory_as_under_ddp(tmp_path, caplog):
    """As a GPU out of memory: the rank is lost (a membership event), the big one goes on."""
    result = _run(tmp_path, "none", plan="none")
    assert result.summary.lost_ranks == [1]
    assert "OutOfMemoryError: rank 1 out of memory (CPU rig, cluster.memory_mb=20)" in caplog.text


@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_async", "cpu_cadence"])
def test_every_mode_trains_under_the_plan(tmp_path, mode):
    result = _run(tmp_path, mode, mode=mode)
    s = result.summary
    assert s.status == "ok" and result.coverage_exact
    # nccl_sync: a share of the state on the device is preferred to all of it on the host
    # (tests/integration/test_sharded_state.py)
    expected = "optimizer state sharded (" if mode == "nccl_sync" else "optimizer state on host"
    assert _plans(s)[1].startswith(f"batch 32, {expected}")
    _within_budgets(s, (BIG, SMALL))
    assert s.eval_value > 0.5


def test_recompute_and_offload_compose_with_precision_and_accumulation(tmp_path):
    result = _run(
        tmp_path,
        "both",
        plan=["none", "recompute+offload"],
        precision="bf16-mixed",
        accumulate_grad_batches=2,
    )
    s = result.summary
    assert s.status == "ok" and result.coverage_exact
    assert _plans(s)[1] == "batch 32, activation checkpointing, optimizer state on host"
    _within_budgets(s, (BIG, SMALL))


def test_a_lost_offloading_rank_then_a_resume_on_another_world_size(tmp_path):
    """3 ranks with plans, a checkpoint each epoch, the offloading rank 2 killed mid-run: the
    others finish; the bundle (rank 1's optimizer state came from the host) then resumes on 2
    ranks, rank 1 again offloading, and trains on."""
    stem = str(tmp_path / "ckpt" / "run")
    killed: list[int] = []

    def kill(m):
        if m.epoch == 1 and not killed:
            os.kill(rank_pid(2), signal.SIGKILL)
            killed.append(2)

    builder, _ = _builder(tmp_path, "lost", memory_mb=(BIG, SMALL, SMALL), epochs=3, n_train=3072)
    cfg = builder.build_config().with_(save_path=stem, checkpoint_every=1)
    handle = builder.config(cfg).metrics_fn(kill).run()
    handle.join(timeout=300)
    s = handle.result.summary
    assert killed == [2] and s.status == "ok" and s.lost_ranks == [2]
    assert _plans(s)[2] == "batch 32, optimizer state on host"

    builder, _ = _builder(tmp_path, "resumed", memory_mb=(BIG, SMALL), epochs=4, n_train=3072)
    cfg = builder.build_config().with_(resume_from=stem)
    handle = builder.config(cfg).run()
    handle.join(timeout=300)
    r = handle.result
    assert r.summary.status == "ok" and [m.epoch for m in r.epochs] == [4]
    assert _plans(r.summary)[1] == "batch 32, optimizer state on host"
    _within_budgets(r.summary, (BIG, SMALL))


def test_a_budget_below_the_parameters_is_refused_before_any_rank(tmp_path):
    builder, _ = _builder(tmp_path, "refused", memory_mb=(BIG, 6.0))
    with pytest.raises(ConfigError, match=r"rank 1 needs >= 8\.\d MiB .* its budget is 6\.0 MiB"):
        builder.run()
