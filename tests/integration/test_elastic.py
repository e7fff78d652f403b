"""Elastic membership: a rank killed mid-run is dropped, survivors regroup and finish, and
every sample of every epoch is still trained exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import accuracy, classification_step
from flodl.runtime.controller.events import RunFailed

from .helpers import bn_model_factory, data, model_factory, optim_factory, rank_pid

pytestmark = pytest.mark.slow


def killing_run(
    tmp_path, mode, ranks, victim, kill_at_epoch=1, epochs=3, model=model_factory, **trainer
):
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
        model,
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


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async", "nccl_sync"])
def test_kill_one_of_three_ranks_mid_run(tmp_path, mode):
    handle, killed = killing_run(tmp_path, mode, ranks=3, victim=2)
    handle.join(timeout=300)
    result = handle.result
    assert killed == [2]
    assert result.summary.status == "ok"
    assert result.summary.lost_ranks == [2]
    assert result.coverage_exact
    assert result.summary.samples_seen == 3 * 3072
    assert [m.epoch for m in result.epochs] == [1, 2, 3]
    last = result.epochs[-1]
    assert last.per_rank_batch_share[2] == 0.0  # the dead rank did nothing in the last epoch
    assert result.summary.eval_value > 0.8


def test_nccl_sync_with_batchnorm_and_checkpoints_survives_a_lost_rank(tmp_path):
    """nccl_sync averages BatchNorm's statistics inside the step, with the gradients: a rank
    lost there fails that step's collectives together; the survivors regroup, finish with
    exact coverage, keep their buffers equal, and the periodic checkpoints are written."""
    stem = str(tmp_path / "ckpt" / "run")
    handle, killed = killing_run(
        tmp_path, "nccl_sync", ranks=3, victim=2, model=bn_model_factory,
        save_path=stem, checkpoint_every=1,
    )  # fmt: skip
    state = handle.join(timeout=300)
    result = handle.result
    assert killed == [2] and result.summary.status == "ok"
    assert result.summary.lost_ranks == [2] and result.coverage_exact
    assert result.summary.samples_seen == 3 * 3072
    assert result.summary.eval_value > 0.8
    running = {k: v for k, v in state.state_dict().items() if "running" in k}
    assert running and all(torch.isfinite(v).all() for v in running.values())
    from flodl.checkpoint.bundle import load_bundle

    _, meta = load_bundle(stem)
    assert meta.epoch == 3


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
    with pytest.raises(RunFailed, match=r"ranks \[1\] lost, more than trainer.max_failure=0"):
        handle.join(timeout=300)  # a failure (exit 1), not an interruption (130)
    from flodl.checkpoint.bundle import load_bundle

    _, meta = load_bundle(stem)
    assert meta.save_reason == "max_failure"
    assert meta.extra["lost_ranks"] == [1]
    summary = json.loads((tmp_path / "nccl_cadence" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_ranks"] == [1]
    assert (tmp_path / "nccl_cadence" / "model.pt").exists()


@pytest.mark.parametrize("victim", [1, 2])
def test_a_frozen_rank_is_dropped_when_its_heartbeat_goes_stale(tmp_path, victim):
    """Frozen in the middle of the ring (1) or at its end (2). A survivor that fails the
    collective first releases its side of the group at once, so the other survivor, blocked on
    it rather than on the frozen rank, is not left waiting for gloo's timeout (set high here:
    a stall would blow the join timeout)."""
    frozen = []

    def metrics(m):
        if m.epoch == 1 and not frozen:  # after the first epoch
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


_BLOCKED_RANK = """
import socket, sys, time
import torch, torch.distributed as dist
from flodl.runtime.sync import groups
from flodl.runtime.wire.channel import Channel
from flodl.runtime.wire.rank_link import SocketLink

rank, store_port, control_port = (int(a) for a in sys.argv[1:4])
store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=rank == 0, use_libuv=False)
groups.form("gloo", store, rank, 2, 300.0)  # gloo's own timeout: far beyond this test
dist.all_reduce(torch.ones(4))
if rank == 1:
    time.sleep(300)  # alive, connected, but never joins the next collective
link = SocketLink(Channel(socket.create_connection(("127.0.0.1", control_port))), 0,
                  on_regroup=groups.abort)
print("blocked", flush=True)
t0 = time.monotonic()
try:
    groups.wait(dist.all_reduce(torch.ones(4), async_op=True),
                lambda: link.announced_generation > 0)
    print("completed", flush=True)
except groups.Abandoned as exc:
    settled = exc.settled
    print(f"abandoned settled={settled} after {time.monotonic() - t0:.1f} s", flush=True)
groups.release(abandoned=not settled)  # a settled group is destroyed like any failed one
msg = link.recv(timeout=10)
print(type(msg).__name__, msg.generation, dist.is_initialized(), groups.kept(), flush=True)
link.stopping = True
"""


def _line(proc, timeout_s: float = 20.0) -> str:
    """The process's next output line, or an assertion error when none comes in time."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s:.0f} s"
    return proc.stdout.readline().strip()


def test_a_regroup_frees_a_rank_blocked_on_a_live_peer(tmp_path):
    """The hang CI once hit: a survivor blocked in the old group's collective on a peer that is
    alive but has moved on (it failed its own side and waits to regroup). Only the controller's
    Regroup can tell it: the collective is abandoned within the grace after the announcement
    instead of waiting out gloo's timeout (300 s here). The operation stays blocked (gloo cannot
    end it): the group is destroyed but kept alive, and neither the loop nor the exit waits."""
    import socket
    import subprocess
    import sys
    import time

    from flodl.runtime.wire.channel import Channel
    from flodl.runtime.wire.messages import Regroup

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        store_port = probe.getsockname()[1]
    listener = socket.create_server(("127.0.0.1", 0))
    control_port = listener.getsockname()[1]
    script = tmp_path / "blocked_rank.py"
    script.write_text(_BLOCKED_RANK)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(store_port), str(control_port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()
        assert _line(procs[0]) == "blocked"
        time.sleep(1.0)  # let rank 0 sit inside the collective
        sent = time.monotonic()
        Channel(conn).send(Regroup(1, (0,), 0, {0: 1.0}))
        outcome = _line(procs[0])
        # The peer never joins: after the grace the operation is still blocked.
        assert outcome.startswith("abandoned settled=False"), outcome
        # The message still reaches the loop, the group is gone, and the process exits at once
        # (a group still blocked is kept alive, not joined: joining would wait out the timeout).
        assert _line(procs[0]) == "Regroup 1 False 1"
        assert procs[0].wait(timeout=20) == 0
        assert time.monotonic() - sent < 20.0
        conn.close()
    finally:
        listener.close()
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


@pytest.mark.parametrize(
    ("mode", "nth", "checkpoint", "ranks"),
    [("nccl_cadence", 1, True, 2), ("nccl_sync", 2, False, 2), ("nccl_sync", 2, True, 3)],
)
def test_a_rank_lost_in_the_last_average_after_stop_ends_the_run_cleanly(
    tmp_path, monkeypatch, caplog, mode, nth, checkpoint, ranks
):
    """Stop goes out once every window is reported, before the last one is averaged: rank 1
    killed in that average left rank 0 waiting for a regroup that never comes (the run is
    stopping) and the epoch open. One epoch of 2 batches a rank: rank 1's ``nth`` average (the
    first in nccl_cadence; in nccl_sync the calibration's window comes first) is the last one."""
    samples = 64 * ranks
    monkeypatch.setenv("FLODL_CHAOS", f"1:average:{nth}")
    stem = str(tmp_path / "ckpt" / "run")
    trainer = {"save_path": stem} if checkpoint else {}
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(1)
        .elche(ElCheConfig(mode=mode))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=ranks, warmup_steps=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    with caplog.at_level("WARNING", logger="flodl"):
        handle = Trainer.run(
            model_factory,
            optim_factory,
            classification_step,
            cfg,
            dataset=partial(data, "train", samples),
            job_dir=tmp_path / "job",
        )
        handle.join(timeout=60)
    result = handle.result
    # Usually Stop is out when rank 1 dies (the case this test was written for). Under load the
    # survivor's last report can reach the controller after rank 1's death: then the loss is an
    # ordinary mid-run one and the survivors regroup (seen once in CI). Either way the run must
    # end as below.
    assert "lost rank 1 while stopping" in caplog.text or re.search(
        r"lost rank 1 \(.*\); \d rank\(s\) go on", caplog.text
    ), caplog.text
    assert result.summary.status == "ok" and result.summary.lost_ranks == [1]
    assert result.coverage_exact and result.summary.samples_seen == samples
    if checkpoint:
        from flodl.checkpoint.bundle import load_bundle

        payload, meta = load_bundle(stem)
        assert meta.save_reason == "final"
        for key, value in result.state.params.items():
            assert torch.equal(payload["params"][key], value), key
