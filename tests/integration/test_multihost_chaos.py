"""The chaos hook through ssh hosts (issue 17, item 5): a rank on a network-namespace host
(tests/netns_hosts.py), started over real ssh, killed or frozen at a named moment
(flodl/runtime/wire/chaos.py). FLODL_CHAOS reaches the remote ranks through their role env
(flodl/runtime/wire/rank_env.py ``role_env``); each cell checks the survivors finish with exact
coverage
within a bound derived from the heartbeat and start timeouts, and that no remote rank outlives
the run. The whole matrix through ssh: ``python -m bench.chaos.matrix --cohort ssh``."""

from __future__ import annotations

import subprocess
import threading
import time
from functools import partial

import pytest

from flodl import ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory
from .test_multihost import cluster_for, rank_processes, wait_until

pytestmark = pytest.mark.slow

HEARTBEAT_S = 3.0
START_S = 90.0  # python + torch started over ssh on shared cores: slow under load
N_TRAIN = 2048
EPOCHS = 2


def chaos_on_hosts(tmp_path, monkeypatch, hosts, faults, mode="nccl_cadence", ckpt=False):
    """Rank 0 on host 0, ranks 1 and 2 on host 1; ``faults`` in FLODL_CHAOS. Returns the
    result and the wall time of the run."""
    monkeypatch.setenv("FLODL_CHAOS", faults)
    cluster = cluster_for(
        hosts,
        ranks=(1, 2),
        speeds=[[1.0], [0.7, 0.5]],
        heartbeat_timeout_s=HEARTBEAT_S,
        start_timeout_s=START_S,
    )
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(EPOCHS)
        .elche(ElCheConfig(mode=mode))
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
    )
    if ckpt:
        cfg = cfg.with_(save_path=str(tmp_path / "ckpt" / "run"), checkpoint_every=1)
    t0 = time.monotonic()
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", N_TRAIN),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        job_dir=tmp_path / "job",
    )
    handle.join(timeout=180)
    return handle.result, time.monotonic() - t0


def assert_survived(result, lost):
    assert result.summary.status == "ok", result.summary.error
    assert sorted(result.summary.lost_ranks) == lost
    assert result.coverage_exact and result.summary.samples_seen == EPOCHS * N_TRAIN
    assert result.state is not None


def assert_no_rank_left(hosts):
    assert wait_until(lambda: not rank_processes(hosts, 0) and not rank_processes(hosts, 1)), (
        "a remote rank outlived the run"
    )


def test_a_remote_rank_killed_while_a_checkpoint_is_collected(
    tmp_path, monkeypatch, make_test_hosts
):
    """Rank 1 (host 1) dies with its state for epoch 0's checkpoint not yet sent: the partial
    checkpoint is discarded and retried with the survivors; the last bundle loads."""
    hosts = make_test_hosts(2)
    result, wall_s = chaos_on_hosts(tmp_path, monkeypatch, hosts, "1:checkpoint:1", ckpt=True)
    assert_survived(result, [1])
    _, meta = load_bundle(str(tmp_path / "ckpt" / "run"))
    assert (meta.epoch, meta.world_size) == (EPOCHS, 2)  # the last bundle, of the survivors
    assert wall_s < START_S + 60.0
    assert_no_rank_left(hosts)


def test_a_remote_rank_frozen_mid_window_is_dropped(tmp_path, monkeypatch, make_test_hosts, caplog):
    """Rank 2 (host 1) is SIGSTOPped after the first batch of its second window: alive, its ssh
    session open, but silent. It is dropped after heartbeat_timeout_s, the run completes, and
    the frozen process is ended at teardown (a stopped process never reads its stdin lifeline)."""
    hosts = make_test_hosts(2)
    result, wall_s = chaos_on_hosts(tmp_path, monkeypatch, hosts, "2:window:2:stop")
    assert_survived(result, [2])
    assert f"rank 2: no heartbeat for {HEARTBEAT_S:.0f} s; dropping it" in caplog.text
    assert wall_s < START_S + 30.0  # start-up + a run; the loss costs about HEARTBEAT_S
    assert_no_rank_left(hosts)


@pytest.mark.parametrize("moment", ["average", "regroup"])
def test_a_remote_rank_lost_in_cpu_async_averaging_or_regroup(
    tmp_path, monkeypatch, make_test_hosts, moment
):
    """cpu_async through ssh. ``average``: rank 1 dies with its second snapshot sent for
    averaging. ``regroup``: rank 2 dies mid-window, then rank 1 dies while the regroup that
    follows is being formed; rank 0 (host 0) finishes alone."""
    hosts = make_test_hosts(2)
    faults = {"average": "1:average:2", "regroup": "2:window:2,1:regroup:1"}[moment]
    result, wall_s = chaos_on_hosts(tmp_path, monkeypatch, hosts, faults, mode="cpu_async")
    assert_survived(result, {"average": [1], "regroup": [1, 2]}[moment])
    assert wall_s < START_S + 60.0
    assert_no_rank_left(hosts)


def _set_link(hosts, i: int, state: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", hosts.namespaces[i], "ip", "link", "set", hosts.interface, state],
        check=True,
        timeout=10,
    )


@pytest.mark.parametrize("cut_s", [12.0, 1.0])
def test_a_cut_link_stops_the_cut_off_rank_itself(tmp_path, make_test_hosts, caplog, cut_s):
    """Host 1's link goes down mid-run. Longer than the heartbeat timeout (12 s): the
    controller drops rank 2 and closes its channel, the survivors finish, and rank 2 stops
    itself while the link is still down, in about the heartbeat timeout (its channel's bound:
    nothing acknowledged), well before the suite's sshd (ClientAliveInterval 5, 3 probes: 15 s)
    would end its session (was: alive 127 s after a 60 s cut, its sockets open, the controller
    still holding its connection). Shorter (1 s): nothing is lost."""
    hosts = make_test_hosts(2)
    cluster = cluster_for(
        hosts, ranks=(2, 1), speeds=[[1.0, 0.7], [0.5]], heartbeat_timeout_s=HEARTBEAT_S
    )
    cut: dict[str, float] = {}
    watcher: list[threading.Thread] = []

    def cut_once(m):  # after the first epoch: host 1 off the network for cut_s
        if cut:
            return
        cut["at"] = time.monotonic()
        _set_link(hosts, 1, "down")

        def restore() -> None:
            cut["remote"] = float(len(rank_processes(hosts, 1)))
            while rank_processes(hosts, 1) and time.monotonic() - cut["at"] < cut_s:
                time.sleep(0.1)
            if not rank_processes(hosts, 1):
                cut["gone_after"] = time.monotonic() - cut["at"]
            time.sleep(max(0.0, cut_s - (time.monotonic() - cut["at"])))
            _set_link(hosts, 1, "up")

        watcher.append(threading.Thread(target=restore, daemon=True))
        watcher[0].start()

    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", N_TRAIN))
        .batch_size(32)
        .num_epochs(6)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(cut_once)
        .output_dir(tmp_path / "job")
        .run()
    )
    try:
        handle.join(timeout=240)
    finally:
        if watcher:  # the cut lasts cut_s whenever the run ends: the cut-off rank is watched
            watcher[0].join(timeout=cut_s + 10)
    result = handle.result
    assert cut.get("remote") == 1.0, cut  # rank 2 was running on host 1 when the link went
    assert result.summary.status == "ok", result.summary.error
    assert result.coverage_exact and result.summary.samples_seen == 6 * N_TRAIN
    if cut_s < HEARTBEAT_S:
        assert result.summary.lost_ranks == []
        return
    assert result.summary.lost_ranks == [2]
    assert f"rank 2: no heartbeat for {HEARTBEAT_S:.0f} s; dropping it" in caplog.text
    assert "gone_after" in cut, "rank 2 was still running when the link came back"
    assert cut["gone_after"] < 2 * HEARTBEAT_S + 3.0, cut  # its own bound, not sshd's 15 s
    assert_no_rank_left(hosts)
