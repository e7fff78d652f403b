"""Bulk tensors through /dev/shm in real runs: the ranks of the CPU rig share the launcher's host,
so their snapshots, averages and final weights go through shared memory; the result is the
very same as over TCP, and a rank lost mid-run with checkpoints on is survived as over TCP."""

from __future__ import annotations

import os
import re
import signal
from functools import partial
from pathlib import Path

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.recipes.models import MLP
from flodl.recipes.steps import classification_step
from flodl.runtime.wire import shm

from .helpers import CLASSES, SHAPE, data, optim_factory, rank_pid

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm"),
]

HIDDEN = 4096  # 282 k parameters: a snapshot of 1.1 MB, past shm.MIN_BYTES
N_TRAIN = 768
_SUMMARY = re.compile(r"(\d+) messages to the launcher and (\d+) from it went through shared")


def _orphans() -> set[str]:
    """flodl names in /dev/shm that no live channel needs: memory leaked until reboot."""
    import psutil

    out = set()
    for name in os.listdir(shm.SHM_DIR):
        if name.startswith(shm.PREFIX):
            pid = name[len(shm.PREFIX) :].split("-")[0]
            # a dead process's, or this one's (the launcher: its channels are closed by now)
            if pid.isdigit() and (int(pid) == os.getpid() or not psutil.pid_exists(int(pid))):
                out.add(name)
    return out


@pytest.fixture(autouse=True)
def no_names_left_behind():
    before = _orphans()
    yield
    assert _orphans() <= before  # killed ranks included: the launcher swept their names


def wide_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(SHAPE, CLASSES, hidden=HIDDEN).to(device)


def run(
    tmp_path: Path,
    mode: str,
    shared_memory: bool,
    ranks: int = 2,
    epochs: int = 2,
    victim: int | None = None,
    **trainer,
):
    def metrics(m):
        if victim is not None and m.epoch == 1:
            os.kill(rank_pid(victim), signal.SIGKILL)

    cfg = (
        Trainer.builder(wide_model, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(epochs)
        .seed(7)
        .elche(ElCheConfig(mode=mode))
        .cluster(
            ClusterConfig(
                kind="cpu_rig",
                ranks=ranks,
                speeds=[1.0, 0.5, 0.5][:ranks],
                warmup_steps=2,
                shared_memory=shared_memory,
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    handle = Trainer.run(
        wide_model,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", N_TRAIN),
        metrics_fn=metrics,
        job_dir=tmp_path / f"{mode}-{shared_memory}",
    )
    state = handle.join(timeout=240)
    return handle, state


def shared_counts(job: Path, rank: int) -> tuple[int, int] | None:
    text = (job / f"rank_{rank}.log").read_text()
    match = _SUMMARY.search(text)
    return (int(match[1]), int(match[2])) if match else None


def test_cpu_sync_through_shared_memory_equals_the_same_run_over_tcp(tmp_path):
    runs = {flag: run(tmp_path, "cpu_sync", flag) for flag in (True, False)}
    for rank in (0, 1):
        up, down = shared_counts(runs[True][0].job_dir, rank)
        # every window's snapshot went up and its average came down through /dev/shm
        windows = runs[True][0].result.summary.syncs
        assert up >= windows and down >= windows - 1, (up, down, windows)
        text = (runs[False][0].job_dir / f"rank_{rank}.log").read_text()
        assert "go over TCP" in text and shared_counts(runs[False][0].job_dir, rank) is None
    shm_state, tcp_state = runs[True][1], runs[False][1]
    assert shm_state.params.keys() == tcp_state.params.keys()
    for name, value in shm_state.params.items():  # lock-step, 2 ranks: bit for bit the same
        assert torch.equal(value, tcp_state.params[name]), name
    assert runs[True][0].result.summary.syncs == runs[False][0].result.summary.syncs


def test_cpu_async_averages_through_shared_memory(tmp_path):
    handle, state = run(tmp_path, "cpu_async", True)
    summary = handle.result.summary
    assert summary.status == "ok" and summary.syncs > 0
    for rank in (0, 1):
        up, down = shared_counts(handle.job_dir, rank)
        assert up >= summary.syncs // 2 and down > 0, (rank, up, down, summary.syncs)
    assert all(torch.isfinite(v).all() for v in state.params.values())


def test_a_rank_killed_with_checkpoints_every_epoch_through_shared_memory(tmp_path):
    """cpu_sync on 3 ranks, a bundle every epoch, rank 1 SIGKILLed after the first epoch: the
    survivors finish, the launcher's mappings of the lost rank's file stay valid, the last
    bundle loads and holds the final weights."""
    stem = str(tmp_path / "ckpt" / "run")
    handle, state = run(
        tmp_path,
        "cpu_sync",
        True,
        ranks=3,
        epochs=3,
        victim=1,
        save_path=stem,
        checkpoint_every=1,
    )
    summary = handle.result.summary
    assert summary.status == "ok" and summary.epochs == 3 and summary.lost_ranks == [1]
    payload, meta = load_bundle(stem)
    assert meta.epoch == 3 and meta.extra["ranks"] == [0, 2]
    for name, value in state.params.items():
        assert torch.equal(payload["params"][name], value), name
    for rank in (0, 2):
        up, down = shared_counts(handle.job_dir, rank)
        assert up > 0 and down > 0


@pytest.mark.parametrize(
    ("mode", "moment", "victim"),
    [
        ("cpu_sync", "report", 1),  # its snapshot is in the launcher's hands, the rank is gone
        ("cpu_async", "average", 0),  # lost while its averages come down through /dev/shm
        ("cpu_sync", "final", 0),  # lost before its final weights: the next survivor's go up
    ],
)
def test_a_rank_lost_at_a_shared_memory_moment_is_survived(
    tmp_path, monkeypatch, mode, moment, victim
):
    nth = {"report": 3, "average": 2, "final": 1}[moment]  # past the first round where it can
    monkeypatch.setenv("FLODL_CHAOS", f"{victim}:{moment}:{nth}")
    handle, state = run(tmp_path, mode, True, ranks=3, epochs=2)
    summary = handle.result.summary
    assert summary.status == "ok", summary.error
    assert summary.lost_ranks == [victim] and summary.epochs == 2
    assert state is not None and all(torch.isfinite(v).all() for v in state.params.values())
    survivors = [r for r in range(3) if r != victim]
    for rank in survivors:
        counts = shared_counts(handle.job_dir, rank)
        assert counts is not None and counts[0] > 0, (rank, counts)
