"""Liveness is judged from when heartbeats arrive, and the judge's own stalls are excused: a slow
callback or a paused launcher never gets healthy ranks dropped (no processes)."""

from __future__ import annotations

import logging
import time

from flodl.config import ClusterConfig, TrainerConfig
from flodl.runtime.controller.controller import Controller
from flodl.runtime.controller.membership import Membership
from flodl.runtime.wire.messages import Heartbeat, Ready


class FakeLink:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def _formed(timeout_s: float = 0.6) -> tuple[Controller, list[int]]:
    cfg = TrainerConfig(
        num_epochs=1, batch_size=10, cluster=ClusterConfig(heartbeat_timeout_s=timeout_s)
    )
    ctl = Controller(cfg, 2, [1.0, 1.0], has_eval=False)
    killed: list[int] = []
    ctl.hooks.kill_rank = killed.append
    for rank in range(2):
        ctl.attach(rank, FakeLink())
        ctl.handle(rank, Ready(rank, "sig", 10, 1.0, "cpu", 100))
    return ctl, killed


def test_excuse_moves_every_clock_forward():
    m = Membership(3, heartbeat_timeout_s=5.0)
    for r in range(3):
        m.seen(r, now=100.0)
    assert m.stale(now=106.0) == [0, 1, 2]
    m.excuse(4.0)
    assert m.stale(now=106.0) == []
    assert m.stale(now=109.5) == [0, 1, 2]


def test_heartbeats_that_arrive_while_the_controller_is_busy_keep_ranks_alive(caplog):
    ctl, killed = _formed()
    for rank in range(2):
        ctl.members.seen(rank)  # last heard of when the controller thread went busy
    ctl.check_deadlines()
    time.sleep(0.7)  # the controller thread was busy (a slow metrics_fn) past the timeout...
    for rank in range(2):
        ctl.post(rank, Heartbeat(rank))  # ...while the ranks' heartbeats kept arriving
    ctl.check_deadlines()
    assert killed == [] and ctl.alive == [0, 1]


def test_a_paused_launcher_does_not_drop_its_ranks():
    ctl, killed = _formed()
    for rank in range(2):
        ctl.post(rank, Heartbeat(rank))
    ctl.check_deadlines()
    time.sleep(1.2)  # nothing ran: SIGSTOP of the whole launcher, heartbeats unread in sockets
    ctl.check_deadlines()
    assert killed == [] and ctl.alive == [0, 1]


def test_a_silent_rank_is_still_dropped():
    ctl, killed = _formed()
    ctl.post(1, Heartbeat(1))
    for _ in range(8):  # the judge runs normally; rank 1 stays silent, rank 0 beats
        ctl.post(0, Heartbeat(0))
        ctl.check_deadlines()
        time.sleep(0.1)
    assert killed == [1] and 1 not in ctl.alive


def test_a_slow_handler_is_warned_about(caplog, monkeypatch):
    ctl, _ = _formed(timeout_s=0.2)
    monkeypatch.setattr(ctl, "_dispatch", lambda rank, msg: time.sleep(0.15))
    with caplog.at_level(logging.WARNING, logger="flodl.runtime.controller.controller"):
        ctl.handle(0, Heartbeat(0))
    assert any("busy" in r.getMessage() and "Heartbeat" in r.getMessage() for r in caplog.records)
