"""Training features through the Python API: per-step LR, LR announcement, precision,
accumulation, compile. In-process runs (one rank, no process) are ``light``; the 2-rank rig
runs are ``slow``."""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import pytest
import torch

from flodl import ClusterConfig, EpochMetrics, LoggerConfig, Trainer
from flodl.schedules import RunLength, advance_to
from recipes.steps import classification_step

from .helpers import data, model_factory

N_TRAIN = 512


def sgd(params: Any, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total_steps)


def local(tmp_path, name: str, epochs: int = 3, batch: int = 32, **cluster: Any):
    """A builder for a one-rank, in-process run (no rank process)."""
    return (
        Trainer.builder(model_factory, sgd, classification_step)
        .dataset(partial(data, "train", N_TRAIN))
        .batch_size(batch)
        .num_epochs(epochs)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=1, warmup_steps=2, **cluster))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / name)
    )


@pytest.mark.light
def test_one_cycle_per_step_follows_the_run_clock_and_is_announced(tmp_path, caplog):
    """The measured bug: OneCycleLR under a per-epoch scheduler never left warm-up. Per step,
    each epoch ends on the schedule's value at that epoch's global progress."""
    seen: list[EpochMetrics] = []
    caplog.set_level(logging.INFO, logger="flodl")
    handle = (
        local(tmp_path, "onecycle")
        .scheduler(one_cycle, interval="step")
        .metrics_fn(seen.append)
        .run()
    )
    handle.join(timeout=120)
    run = RunLength(3 * N_TRAIN, 32)
    reference = one_cycle(sgd([torch.nn.Parameter(torch.zeros(1))]), run.total_steps)
    expected = []
    for epoch in range(3):
        advance_to(reference, run.target_step((epoch + 1) * N_TRAIN))
        expected.append(reference.optimizer.param_groups[0]["lr"])
    assert [m.lr for m in seen] == pytest.approx(expected)
    assert expected[0] > 0.1  # a third of the way in: near max_lr, far past warm-up
    assert expected[-1] < expected[0] / 100  # annealed: the end of the cycle
    assert "lr 0.05 \u00d7 1.0 (lr_scale_ratio 1.0, 1 rank) = 0.05" in caplog.text
    summary = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary["lr_scaling"] == {
        "base_lr": 0.05,
        "factor": 1.0,
        "lr_scale_ratio": 1.0,
        "world_size": 1,
        "lr": 0.05,
    }


@pytest.mark.light
def test_per_step_scheduler_under_epoch_interval_is_warned_at_launch(tmp_path, caplog):
    seen: list[EpochMetrics] = []
    handle = local(tmp_path, "warned", epochs=2).scheduler(one_cycle).metrics_fn(seen.append).run()
    handle.join(timeout=120)
    warned = [r for r in caplog.records if "scheduler.interval=epoch" in r.getMessage()]
    assert len(warned) == 1 and "OneCycleLR" in warned[0].getMessage()
    # Stepped once per epoch, as asked; its total_steps is then the run's length in epochs.
    reference = one_cycle(sgd([torch.nn.Parameter(torch.zeros(1))]), 2)
    assert seen[0].lr == pytest.approx(reference.optimizer.param_groups[0]["lr"])
