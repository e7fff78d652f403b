"""Callbacks and options through the Python API, on a real 2-rank rig."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, EpochMetrics, LoggerConfig, Trainer
from flodl.recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _builder(tmp_path, mode="nccl_cadence", **elche):
    return (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 768))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(3)
        .elche(ElCheConfig(mode=mode, **elche))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / mode)
    )


def test_metrics_eval_epoch_callbacks_and_scheduler(tmp_path):
    metrics: list[EpochMetrics] = []
    evals: list[tuple[int, float]] = []
    epochs: list[int] = []
    handle = (
        _builder(tmp_path)
        .metrics_fn(metrics.append)
        .eval_result_fn(lambda epoch, value: evals.append((epoch, value)))
        .epoch_fn(epochs.append)
        .scheduler(step_lr)
        .max_grad_norm(1.0)
        .run()
    )
    handle.join(timeout=240)
    assert [m.epoch for m in metrics] == [1, 2, 3] == epochs  # as the console counts
    assert [e for e, _ in evals] == [1, 2, 3]
    assert [m.eval_value for m in metrics] == [v for _, v in evals]
    m = metrics[-1]
    assert len(m.per_rank) == len(m.per_rank_throughput) == len(m.per_rank_batch_share) == 2
    assert m.syncs > 0 and m.anchor >= 1 and m.epoch_ms > 0
    assert "accuracy" in m.scalars and 0 <= m.scalars["accuracy"] <= 1  # record_scalar
    # LR: 1e-2 x 2 (linear scaling for 2 ranks), halved every epoch by the per-rank scheduler.
    assert [m.lr for m in metrics] == pytest.approx([2e-2, 1e-2, 5e-3])


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_nesterov_outer_trains_and_changes_the_trajectory(tmp_path, mode):
    plain = _builder(tmp_path / "plain", mode).run()
    plain_state = plain.join(timeout=240)
    outer = _builder(tmp_path / "outer", mode, outer="nesterov", outer_lr=0.7).run()
    outer_state = outer.join(timeout=240)
    assert outer.result.summary.eval_value > 0.8
    assert outer.result.coverage_exact
    diff = sum(
        float((plain_state.params[k] - outer_state.params[k]).abs().sum())
        for k in plain_state.params
    )
    assert diff > 1e-3


def test_a_callback_slower_than_the_heartbeat_timeout_drops_no_rank(tmp_path):
    """metrics_fn runs on the controller's thread; a 5 s one with a 2 s heartbeat timeout used
    to get both healthy ranks dropped as stale."""
    seen: list[EpochMetrics] = []

    def slow(m: EpochMetrics) -> None:
        seen.append(m)
        time.sleep(5.0)

    handle = (
        _builder(tmp_path)
        .num_epochs(2)
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3, heartbeat_timeout_s=2.0
            )
        )
        .metrics_fn(slow)
        .run()
    )
    handle.join(timeout=240)
    result = handle.result
    assert len(seen) == 2
    assert result.summary.lost_ranks == [] and result.summary.world_size == 2
    assert result.coverage_exact
