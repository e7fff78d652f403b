"""A rank lost at any moment of start-up, group formation included, is survived like any other
loss, or fails the job at once naming it (issue 41, item 4); lost-rank messages and failed
summaries say what happened (item 6). Real 2- and 3-rank runs over gloo, the rank SIGKILLed at
a named moment (flodl/runtime/wire/chaos.py)."""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import accuracy, classification_step
from flodl.runtime.controller.controller import RunFailed

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow

START_S = 30.0  # cluster.start_timeout_s: what a stalled formation used to wait out


def _run(tmp_path, monkeypatch, faults: str, ranks: int = 3, mode: str = "nccl_cadence", **kw):
    monkeypatch.setenv("FLODL_CHAOS", faults)
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode=mode))
        .cluster(
            ClusterConfig(
                kind="cpu_rig",
                ranks=ranks,
                speeds=[1.0, 0.7, 0.5][:ranks],
                warmup_steps=2,
                heartbeat_timeout_s=3.0,
                start_timeout_s=START_S,
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**kw)
    )
    t0 = time.perf_counter()
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", 1024),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        job_dir=tmp_path / "job",
    )
    error = None
    try:
        handle.join(timeout=120)
    except RunFailed as exc:
        error = str(exc)
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    return summary, error, time.perf_counter() - t0


@pytest.mark.parametrize(
    "fault",
    [
        "1:hello",  # before it reaches the controller
        "1:join",  # the job received, no group yet
        "1:form",  # every member at the group's barrier: was a 30 s stall, then a failed job
        "1:form:1:kill@0.015",  # inside init_process_group (gloo connecting the members)
        "0:form:1:kill@0.03",  # rank 0, the weights' source, the same way
    ],
)
def test_a_rank_killed_at_each_start_up_moment_is_survived(tmp_path, monkeypatch, fault):
    """Was (1:form, and 7 of 12 kills in a rank's first 0.1 s): the survivors sat inside
    init_process_group until start_timeout_s, then "ranks [0, 2] did not get ready" named the
    healthy ranks."""
    summary, error, wall_s = _run(tmp_path, monkeypatch, fault)
    victim = int(fault.split(":")[0])
    assert error is None and summary["status"] == "ok", (error, summary)
    assert summary["lost_ranks"] == [victim]
    assert summary["coverage_exact"] and summary["samples_seen"] == 2 * 1024
    assert summary["epochs"] == 2
    assert wall_s < START_S, wall_s  # never waits out the formation's timeout


def test_too_few_left_at_start_up_fails_at_once_naming_the_lost_rank(tmp_path, monkeypatch):
    """max_failure=0: the loss in group formation ends the job now, naming rank 1 and how it
    died; the summary says which rank was lost (was: lost_ranks [] in every failed summary)."""
    summary, error, wall_s = _run(tmp_path, monkeypatch, "1:form", ranks=2, max_failure=0)
    assert error is not None and "rank 1 killed by SIGKILL — out of memory?" in error, error
    assert "max_failure=0" in error
    assert summary["status"] == "failed" and summary["lost_ranks"] == [1]
    assert summary["epochs"] == 0
    assert wall_s < START_S / 2, wall_s


def test_a_killed_rank_is_named_with_its_signal(tmp_path, monkeypatch, caplog):
    """Was: "rank 1 lost its control channel (peer closed the control channel)", the same for
    an OOM kill and a clean os._exit(0)."""
    with caplog.at_level(logging.WARNING, logger="flodl"):
        summary, error, _ = _run(tmp_path, monkeypatch, "1:window:2")
    assert error is None and summary["lost_ranks"] == [1]
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost rank 1")]
    assert lost and "rank 1 killed by SIGKILL — out of memory?" in lost[0], lost


def test_every_rank_lost_is_in_the_failed_summary(tmp_path, monkeypatch):
    """Was: a failed summary had lost_ranks [] after every rank was lost, and epochs 0."""
    summary, error, _ = _run(tmp_path, monkeypatch, "0:window:3,1:window:3", ranks=2)
    assert error is not None and "every rank was lost" in error, error
    assert summary["status"] == "failed" and sorted(summary["lost_ranks"]) == [0, 1]
