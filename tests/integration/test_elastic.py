"""Elastic membership: a rank killed mid-run is dropped, survivors regroup and finish, and
every sample of every epoch is still trained exactly once."""

from __future__ import annotations

import os
import signal
from functools import partial

import psutil
import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def rank_pid(rank: int) -> int:
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.environ().get("FLODL_RANK") == str(rank):
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise LookupError(f"no process for rank {rank}")


def killing_run(tmp_path, mode, ranks, victim, kill_at_epoch=0, epochs=3, **trainer):
    killed = []

    def metrics(m):
        if m.epoch == kill_at_epoch and not killed:
            os.kill(rank_pid(victim), signal.SIGKILL)
            killed.append(victim)

    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 3072))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode))
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=ranks, speeds=[1.0, 0.7, 0.5][:ranks], warmup_steps=2
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(metrics)
        .output_dir(tmp_path / mode)
    )
    cfg = builder.build_config().with_(**trainer)
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", 3072),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        metrics_fn=metrics,
        job_dir=tmp_path / mode,
    )
    return handle, killed


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_kill_one_of_three_ranks_mid_run(tmp_path, mode):
    handle, killed = killing_run(tmp_path, mode, ranks=3, victim=2)
    handle.join(timeout=300)
    result = handle.result
    assert killed == [2]
    assert result.summary.status == "ok"
    assert result.summary.lost_ranks == [2]
    assert result.coverage_exact
    assert result.summary.samples_seen == 3 * 3072
    assert [m.epoch for m in result.epochs] == [0, 1, 2]
    last = result.epochs[-1]
    assert last.per_rank_batch_share[2] == 0.0  # the dead rank did nothing in the last epoch
    assert result.summary.eval_value > 0.8


def test_lone_survivor_finishes_alone(tmp_path):
    handle, _killed = killing_run(tmp_path, "nccl_cadence", ranks=2, victim=1, epochs=2)
    handle.join(timeout=300)
    result = handle.result
    assert result.summary.lost_ranks == [1] and result.coverage_exact
    assert result.epochs[-1].per_rank_batch_share == [1.0, 0.0]


def test_max_failure_saves_and_stops(tmp_path):
    stem = str(tmp_path / "ckpt" / "run")
    handle, _killed = killing_run(
        tmp_path, "nccl_cadence", ranks=3, victim=1, epochs=4, max_failure=0, save_path=stem
    )
    with pytest.raises(KeyboardInterrupt):
        handle.join(timeout=300)
    from flodl.checkpoint import load_bundle

    _, meta = load_bundle(stem)
    assert meta.save_reason == "max_failure"
    assert meta.extra["lost_ranks"] == [1]
    summary = (tmp_path / "nccl_cadence" / "summary.json").read_text()
    assert '"status": "interrupted"' in summary


@pytest.mark.parametrize("victim", [1, 2])
def test_a_frozen_rank_is_dropped_when_its_heartbeat_goes_stale(tmp_path, victim):
    """Frozen in the middle of the ring (1) or at its end (2). A survivor that fails the
    collective first releases its side of the group at once, so the other survivor, blocked on
    it rather than on the frozen rank, is not left waiting for gloo's timeout (set high here:
    a stall would blow the join timeout)."""
    frozen = []

    def metrics(m):
        if m.epoch == 0 and not frozen:
            os.kill(rank_pid(victim), signal.SIGSTOP)  # alive but silent: only heartbeats tell
            frozen.append(victim)

    cluster = ClusterConfig(
        kind="cpu_rig",
        ranks=3,
        speeds=[1.0, 0.7, 0.5],
        warmup_steps=2,
        heartbeat_timeout_s=4.0,
        start_timeout_s=600.0,
    )
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 2048))
        .batch_size(32)
        .num_epochs(2)
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(metrics)
        .output_dir(tmp_path)
        .run()
    )
    handle.join(timeout=120)
    result = handle.result
    assert frozen == [victim]
    assert result.summary.lost_ranks == [victim]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 2048
