"""Checkpoints and rank loss together: a rank (rank 0 included) SIGKILLed while every epoch is
checkpointed; the run completes, ends right after its last window, and its bundle loads and
resumes on fewer and on more ranks."""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.recipes.steps import classification_step

from .helpers import data, model_factory, optim_factory, rank_pid

pytestmark = pytest.mark.slow

N_TRAIN = 1536


def run(tmp_path, name, ranks, epochs, victim=None, mode="nccl_cadence", **trainer):
    """A tiny run on ``ranks`` CPU ranks; ``victim`` is SIGKILLed once the first epoch closed.
    Returns the handle and the time the last epoch closed."""
    ends: list[float] = []

    def metrics(m):
        ends.append(time.perf_counter())
        if victim is not None and m.epoch == 1 and len(ends) == 1:
            os.kill(rank_pid(victim), signal.SIGKILL)

    speeds = [1.0, 0.7, 0.5][:ranks]
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=ranks, speeds=speeds, warmup_steps=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", N_TRAIN),
        metrics_fn=metrics,
        job_dir=tmp_path / name,
    )
    handle.join(timeout=180)
    return handle, ends[-1]


def killed_run(tmp_path, mode: str, victim: int) -> dict:
    """3 ranks, 3 epochs, every epoch checkpointed; ``victim`` SIGKILLed after the first."""
    stem = str(tmp_path / "ckpt" / "run")
    handle, last_epoch = run(
        tmp_path, "killed", 3, 3, victim=victim, mode=mode, save_path=stem, checkpoint_every=1
    )
    return {"handle": handle, "tail_s": time.perf_counter() - last_epoch, "stem": stem}


@pytest.fixture(scope="module")
def rank1_killed(tmp_path_factory) -> dict:
    """Shared: its final bundle (saved by the 2 survivors) is also what the resumes start from."""
    return killed_run(tmp_path_factory.mktemp("rank1_killed"), "nccl_cadence", 1)


# Rank 0 writes the weights, every rank its own optimizer shard: victim 0 is the writer, victim 1
# a rank that writes only its own shard (rank 2 would take the same path as rank 1).
@pytest.mark.parametrize(
    ("mode", "victim"),
    [("nccl_cadence", 0), ("nccl_cadence", 1), ("cpu_async", 0)],
)
def test_killed_rank_with_checkpoint_every_epoch(tmp_path, request, mode, victim):
    shared = (mode, victim) == ("nccl_cadence", 1)
    killed = request.getfixturevalue("rank1_killed") if shared else None
    killed = killed or killed_run(tmp_path, mode, victim)
    handle, tail_s, stem = killed["handle"], killed["tail_s"], killed["stem"]
    result = handle.result
    assert result.summary.status == "ok", result.summary.error
    assert result.summary.lost_ranks == [victim] and result.coverage_exact
    assert tail_s < 15.0, f"the run took {tail_s:.1f} s to end after its last epoch"
    payload, meta = load_bundle(stem)
    survivors = [r for r in range(3) if r != victim]
    assert (meta.save_reason, meta.epoch, meta.world_size) == ("final", 3, 2)
    assert sorted(payload["optimizer"]) == survivors
    assert meta.extra["lost_ranks"] == [victim]
    final = result.state
    assert final is not None
    for key, value in final.params.items():  # the bundle's weights are the final weights
        assert torch.equal(payload["params"][key], value), key
    leftovers = sorted(p.name for p in Path(stem).parent.iterdir() if p.suffix != ".lock")
    assert len(leftovers) == 1 + len(meta.shards), leftovers  # no orphan shard survives
    assert (Path(stem).parent / "run.lock").exists()  # the saver's lock (flodl/checkpoint/lock.py)
    # plain averaging keeps no controller-side state (cpu_async's EASGD blend is the ranks'):
    # no controller shard; outer=nesterov's is in test_resume
    assert "controller" not in payload


def test_post_loss_bundle_resumes_on_fewer_and_more_ranks(tmp_path, rank1_killed):
    stem = rank1_killed["stem"]
    _, meta = load_bundle(stem)
    assert (meta.epoch, meta.world_size, meta.extra["ranks"]) == (3, 2, [0, 2])
    for ranks in (1, 3):
        resumed, _ = run(tmp_path, f"on{ranks}", ranks, 4, resume_from=stem)
        result = resumed.result
        state = result.state
        assert result.summary.status == "ok" and result.summary.world_size == ranks
        assert [m.epoch for m in result.epochs] == [
            4
        ]  # (counting from 1) the saved epochs are not trained again
        assert result.coverage_exact and result.summary.samples_seen == N_TRAIN
        assert all(torch.isfinite(v).all() for v in state.params.values())


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_lost_while_writing_its_shard(tmp_path, monkeypatch, caplog, victim):
    """Killed at its first checkpoint, before its shard is written (chaos point): rank 0 was
    writing the weights, so that save is discarded; rank 1's save commits without its state.
    Either way nothing waits, and the later saves and the final bundle work."""
    monkeypatch.setenv("FLODL_CHAOS", f"{victim}:checkpoint")
    stem = str(tmp_path / "ckpt" / "run")
    with caplog.at_level("WARNING", logger="flodl.runtime.controller.snapshots"):
        handle, last_epoch = run(tmp_path, "chaos", 3, 3, save_path=stem, checkpoint_every=1)
    tail_s = time.perf_counter() - last_epoch
    result = handle.result
    assert result.summary.status == "ok", result.summary.error
    assert result.summary.lost_ranks == [victim] and result.coverage_exact
    assert tail_s < 15.0, f"the run took {tail_s:.1f} s to end after its last epoch"
    discarded = "which was writing the weights, was lost" in caplog.text
    assert discarded == (victim == 0), caplog.text
    payload, meta = load_bundle(stem)
    assert (meta.save_reason, meta.epoch, meta.extra["ranks"]) == (
        "final",
        3,
        [r for r in range(3) if r != victim],
    )
    assert all(torch.equal(payload["params"][k], v) for k, v in result.state.params.items())


@pytest.mark.parametrize(
    ("mode", "moment"), [("nccl_cadence", "final"), ("cpu_async", "final_save")]
)
def test_rank_lost_while_sending_the_final_weights(tmp_path, monkeypatch, caplog, mode, moment):
    """Rank 0 owes the final weights after Stop and dies before sending them ("final", its
    shards written) or before writing the save's weights ("final_save"). Was: the run failed.
    Now rank 1, held with the same weights, sends them and writes the save's weights."""
    monkeypatch.setenv("FLODL_CHAOS", f"0:{moment}")
    stem = str(tmp_path / "ckpt" / "run")
    with caplog.at_level("WARNING"):
        handle, last_epoch = run(
            tmp_path, "chaos", 3, 2, mode=mode, save_path=stem, checkpoint_every=1
        )
    tail_s = time.perf_counter() - last_epoch
    result = handle.result
    assert result.summary.status == "ok", result.summary.error
    assert result.summary.lost_ranks == [0] and result.coverage_exact
    assert tail_s < 15.0, f"the run took {tail_s:.1f} s to end after its last epoch"
    assert "rank 1 sends them" in caplog.text
    assert ("rank 1 writes them instead" in caplog.text) == (moment == "final_save")
    payload, meta = load_bundle(stem)
    saved = [0, 1, 2] if moment == "final" else [1, 2]  # rank 0's own shard, if it wrote it
    assert (meta.save_reason, meta.epoch, meta.extra["ranks"]) == ("final", 2, saved)
    final = result.state
    assert final is not None and set(final.params) == set(payload["params"])
    for key, value in final.params.items():  # the same weights, whoever wrote or sent them
        assert torch.equal(payload["params"][key], value), key
