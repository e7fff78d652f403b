"""The control plane under hostile peers, and teardown hygiene over many runs."""

from __future__ import annotations

import socket
import threading
from functools import partial

import psutil
import pytest

from flodl import ClusterConfig, LoggerConfig, Trainer
from flodl.recipes.steps import classification_step
from flodl.runtime.cohorts import fork_server
from flodl.runtime.wire.channel import AuthError, connect, new_secret

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def tiny_run(tmp_path, name, metrics_fn=None, epochs=1):
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 256))
        .batch_size(32)
        .num_epochs(epochs)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / name)
    )
    if metrics_fn is not None:
        builder = builder.metrics_fn(metrics_fn)
    return builder.run()


def test_impostors_and_garbage_do_not_disturb_training(tmp_path):
    attempts: dict[str, object] = {}
    holder: dict[str, object] = {}

    def attack(metrics) -> None:
        if metrics.epoch != 1:  # after the first epoch (epochs count from 1)
            return
        host, port = holder["handle"]._job.cohort.control_address
        raw = socket.create_connection((host, port))
        raw.sendall(b"\x00garbage\xff" * 4096)
        raw.close()
        try:
            connect(host, port, new_secret(), timeout_s=5)
        except AuthError as exc:
            attempts["impostor"] = exc
        silent = socket.create_connection((host, port))  # says nothing at all
        threading.Timer(7.0, silent.close).start()

    handle = tiny_run(tmp_path, "attacked", attack, epochs=3)
    holder["handle"] = handle
    handle.join(timeout=240)
    assert isinstance(attempts.get("impostor"), AuthError)
    assert handle.result.summary.status == "ok"
    assert handle.result.coverage_exact
    assert len(handle.result.epochs) == 3


def _listening_ports() -> set[int]:
    me = psutil.Process()
    return {c.laddr.port for c in me.net_connections(kind="tcp") if c.status == "LISTEN"}


def test_consecutive_runs_leak_no_processes_ports_or_fds(tmp_path):
    me = psutil.Process()
    before_ports = _listening_ports()
    fds = []
    for i in range(3):
        tiny_run(tmp_path, f"run{i}").join(timeout=120)
        kept = fork_server.server_pid()  # the fork server stays for the next run, its forks do not
        assert not [
            p for p in me.children(recursive=True) if p.pid != kept and p.status() != "zombie"
        ]
        assert _listening_ports() <= before_ports
        fds.append(me.num_fds())
    # The first run may warm lazily opened files (torch, logging); after that: flat, to the
    # descriptor (measured flat from the first run on), so one leaked per run shows as +1.
    assert fds[2] <= fds[1], fds
