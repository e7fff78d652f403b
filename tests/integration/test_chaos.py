"""The chaos matrix's in-suite part: faults that used to hang or fail a run, each a real 3-rank
run with a rank killed at a named moment (flodl/runtime/wire/chaos.py). The whole matrix:
``python -m bench.chaos.matrix`` (README: "Chaos matrix")."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest

from flodl import ClusterConfig, ControllerAddress, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def faulted_run(
    tmp_path,
    monkeypatch,
    faults: str,
    mode: str = "nccl_cadence",
    epochs: int = 2,
    controller_port: int = 0,
):
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
                controller=ControllerAddress(port=controller_port),
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


def _plant_garbage(store_port: int, done: threading.Event) -> None:
    """A stranger on the store's port: lists the keys of the first rendezvous (gloo's keys hold
    ``//``) and plants garbage where the next generations' rendezvous will look. (Overwriting a
    key between its write and its read only delays a rendezvous: README, "Rendezvous store".)"""
    import torch.distributed as dist

    deadline = time.monotonic() + 60
    keys: list[str] = []
    while time.monotonic() < deadline:
        try:
            store = dist.TCPStore("127.0.0.1", store_port, is_master=False, use_libuv=False)
            keys = [k for k in store.list_keys() if "generation0" in k and "//" in k]
        except Exception:  # not up yet
            keys = []
        if len(keys) >= 3:
            break
        time.sleep(0.2)
    garbage = b"\x00garbage\xff" * 64
    for key in keys:
        for generation in range(1, 4):
            store.set(key.replace("generation0", f"generation{generation}"), garbage)
    done.set()


def test_garbage_written_into_the_store_does_not_kill_the_run(tmp_path, monkeypatch):
    """Was: garbage in the rendezvous store killed every rank (gloo parsed it). Values are now
    signed with the run's secret: the regroup after rank 2's loss reads past planted garbage."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    planted = threading.Event()
    threading.Thread(target=_plant_garbage, args=(port + 1, planted), daemon=True).start()
    # The garbage must be in place before the survivors' regroup writes its keys: planted after
    # that write it replaces a genuine value, the documented delay that the regroup's timeout
    # ends in a PermissionError (seen under CI load). The controller starts the regroup here.
    from flodl.runtime.controller.elastic import Elastic

    lose = Elastic.lose

    def lose_once_planted(self, rank, why):
        assert planted.wait(60), "the stranger never planted its garbage"
        lose(self, rank, why)

    monkeypatch.setattr(Elastic, "lose", lose_once_planted)
    result, _ = faulted_run(tmp_path, monkeypatch, "2:window:4", controller_port=port)
    assert planted.is_set()
    assert result.summary.status == "ok" and result.summary.lost_ranks == [2]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 2048


def _run_one(tmp_path, faults: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.chaos.run_one", "--ranks", "2", "--epochs", "2"]
    cmd += ["--n-train", "1024", "--faults", faults, "--ckpt", str(tmp_path / "ckpt")]
    cmd += ["--job-dir", str(tmp_path / "job"), "--timeout", "120"]
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen(
        cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_status(proc: psutil.Process, status: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.status() == status:
            return True
        time.sleep(0.1)
    return False


def test_a_launcher_frozen_while_writing_a_checkpoint_loses_no_healthy_rank(tmp_path):
    """Was: a launcher paused 8 s (heartbeat 3 s) got healthy ranks declared dead."""
    job = _run_one(tmp_path, "launcher:checkpoint_write:1:stop")
    launcher = psutil.Process(job.pid)
    try:
        assert _wait_status(launcher, psutil.STATUS_STOPPED, 90), "the launcher never froze"
        time.sleep(8.0)  # > heartbeat_timeout_s (3 s): the ranks' heartbeats queue meanwhile
        launcher.resume()
        out, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    result = json.loads(out.split("CHAOS-RESULT ", 1)[1])
    assert result["status"] == "ok" and result["lost_ranks"] == [], result
    assert result["coverage_exact"] and result["samples_seen"] == 2 * 1024
    assert result["bundle"].startswith("epoch 2"), result


def test_a_launcher_killed_while_writing_a_checkpoint_leaves_no_rank_and_a_loadable_bundle(
    tmp_path,
):
    """The second save's states are collected, then the launcher dies: its ranks must follow
    it at once (no orphan burns the allocation) and the first epoch's bundle must still load."""
    job = _run_one(tmp_path, "launcher:checkpoint_write:2:kill")
    launcher = psutil.Process(job.pid)
    ranks: set[int] = set()
    while job.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            ranks |= {p.pid for p in launcher.children(recursive=True)}
        time.sleep(0.2)
    assert job.returncode == -signal.SIGKILL
    assert len(ranks) >= 2
    deadline = time.monotonic() + 10.0  # the ranks' parent-death signal / lifeline
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in ranks):
        time.sleep(0.2)
    alive = [p for p in ranks if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"ranks outlived their launcher: {alive}"
    from flodl.checkpoint.bundle import load_bundle

    _, meta = load_bundle(str(tmp_path / "ckpt" / "run"))
    assert meta.epoch == 1
