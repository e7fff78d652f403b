"""The chaos matrix's in-suite part: faults that used to hang or fail a run, each a real 3-rank
run with a rank killed at a named moment (flodl/runtime/chaos.py). The whole matrix:
``python -m tests.chaos.matrix`` (README: "Chaos matrix")."""

from __future__ import annotations

import json
import time
from functools import partial

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def faulted_run(tmp_path, monkeypatch, faults: str, mode: str = "nccl_cadence", epochs: int = 2):
    monkeypatch.setenv("FLODL_CHAOS", faults)
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode))
        .cluster(
            ClusterConfig(
                kind="cpu_rig",
                ranks=3,
                speeds=[1.0, 0.7, 0.5],
                warmup_steps=2,
                heartbeat_timeout_s=3.0,
                start_timeout_s=30.0,
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
    )
    t0 = time.perf_counter()
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", 2048),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        job_dir=tmp_path / "job",
    )
    handle.join(timeout=180)
    return handle.result, time.perf_counter() - t0


def test_two_ranks_killed_at_once_leave_a_survivor_that_finishes(tmp_path, monkeypatch):
    """Was: the survivor waited start_timeout_s to regroup with a dead member, then failed."""
    result, wall_s = faulted_run(tmp_path, monkeypatch, "1:window:2,2:window:2")
    assert result.summary.status == "ok"
    assert sorted(result.summary.lost_ranks) == [1, 2]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 2048
    assert result.epochs[-1].per_rank_batch_share == [1.0, 0.0, 0.0]
    assert wall_s < 30.0 + 20.0  # well inside start_timeout_s + a run; was > start_timeout_s


def test_rank_0_lost_in_start_up_is_survived(tmp_path, monkeypatch):
    """Was: any loss before training failed the job. Rank 0 (the weights' source) included."""
    result, _ = faulted_run(tmp_path, monkeypatch, "0:start", mode="cpu_async")
    assert result.summary.status == "ok" and result.summary.lost_ranks == [0]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 2048
    assert result.state is not None and result.summary.eval_value > 0.5
    assert all(m.per_rank_batch_share[0] == 0.0 for m in result.epochs)


def test_work_of_a_rank_lost_while_averaging_is_trained_again(tmp_path, monkeypatch):
    """Rank 1 reports its second window, then dies entering its averaging: the survivors
    re-average without it, so its work there never reached the model. Coverage must count it
    out (was: counted, and "exact")."""
    result, _ = faulted_run(tmp_path, monkeypatch, "1:average:2")
    assert result.summary.status == "ok" and result.summary.lost_ranks == [1]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 2048
    events = [json.loads(line) for line in (tmp_path / "job" / "elche_trace.jsonl").open()]
    first = next(e for e in events if e["batches"][1] > 0)
    # Only rank 1's first window reached the model; its second was given back and retrained.
    assert result.epochs[0].per_rank[1]["batches"] == first["batches"][1]
