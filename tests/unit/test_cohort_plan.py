"""One plan per planning step for the whole cohort: pickled once, each rank keeps its own part."""

from __future__ import annotations

import pickle
import socket
import time

from flodl.config import ElCheConfig, TrainerConfig
from flodl.runtime.controller.controller import Controller
from flodl.runtime.wire.channel import Channel
from flodl.runtime.wire.messages import (
    CohortPlan,
    Plan,
    PlannedWindow,
    Ready,
    Stop,
    Window,
    own_part,
)
from flodl.runtime.wire.rank_link import SocketLink
from tests.unit.test_controller import FakeLink, drive


def _planned() -> PlannedWindow:
    return PlannedWindow(
        7,
        1,
        {0: ((0, 10),), 2: ((10, 30), (50, 5))},
        {0: (0.25, 0.5), 2: (0.75, 0.5)},
        eval_shards={2: (1, 2)},
        writer=0,
        max_overshoot=3,
        consensus=True,
        checkpoint_after=True,
        generation=2,
        save_tag="t",
        settle=True,
        progress=123,
        window_samples=45,
        grad_sync=True,
    )


def test_each_rank_gets_exactly_the_window_a_per_rank_plan_held():
    p = _planned()
    common = dict(max_overshoot=3, consensus=True, checkpoint_after=True, generation=2,
                  save_tag="t", settle=True, progress=123, window_samples=45,
                  grad_sync=True)  # fmt: skip
    assert p.window(0) == Window(7, 1, ((0, 10),), 0.25, 0.5, write_weights=True, **common)
    assert p.window(2) == Window(
        7, 1, ((10, 30), (50, 5)), 0.75, 0.5, eval_after=True, eval_shard=(1, 2), **common
    )
    plan = CohortPlan((p, p))
    assert own_part(plan, 2) == Plan((p.window(2), p.window(2)))
    assert own_part(plan, 1) is None  # not a member of these windows: nothing for it
    stop = Stop("done")
    assert own_part(stop, 1) is stop


class BytesLink(FakeLink):
    """A socket-like link: takes raw frames, decodes them on arrival as SocketLink does."""

    def __init__(self, rank: int, payloads: list) -> None:
        super().__init__()
        self.rank, self.payloads = rank, payloads

    def send_bytes(self, payload: bytes) -> None:
        self.payloads.append(payload)
        own = own_part(pickle.loads(payload), self.rank)
        if own is not None:
            self.sent.append(own)


def _run(links: list) -> Controller:
    cfg = TrainerConfig(num_epochs=2, batch_size=10, elche=ElCheConfig())
    ctl = Controller(cfg, 4, [1.0, 0.5, 0.7, 0.3], has_eval=True)
    for rank, link in enumerate(links):
        ctl.attach(rank, link)
    for rank in range(4):
        ctl.handle(rank, Ready(rank, "sig", 10, 1.0, "cpu", 2000))
    drive(ctl, links, ms_per_batch=(1.0, 2.0, 1.5, 3.0))
    return ctl


def _windows(link: FakeLink) -> list[Window]:
    return [w for m in link.sent if isinstance(m, Plan) for w in m.windows]


def test_socket_links_get_one_pickle_per_step_and_the_same_plans_as_object_links():
    plain = [FakeLink() for _ in range(4)]
    _run(plain)
    payloads: list[bytes] = []
    shared = [BytesLink(rank, payloads) for rank in range(4)]
    ctl = _run(shared)
    steps = len([m for m in shared[0].sent if isinstance(m, Plan)])
    assert steps > 4
    # Every rank got every payload, the same bytes object: one pickle per planning step.
    assert len({id(p) for p in payloads}) == steps and len(payloads) == 4 * steps
    for rank in range(4):
        assert _windows(shared[rank]) == _windows(plain[rank]) != []
    coverage = ctl.result().coverage
    assert coverage is not None and all(coverage.exact(e) for e in range(2))


def test_a_socket_link_keeps_only_its_own_part_of_a_cohort_plan():
    a, b = socket.socketpair()
    controller_end, rank_end = Channel(a), Channel(b)
    link = SocketLink(rank_end, rank=2, in_launcher=True)
    try:
        p = _planned()
        controller_end.send_bytes(pickle.dumps(CohortPlan((p,))))
        other = PlannedWindow(8, 1, {0: ((0, 5),)}, {0: (1.0, 1.0)})
        controller_end.send_bytes(pickle.dumps(CohortPlan((other,))))
        controller_end.send(Stop("done"))
        assert link.recv(timeout=5) == Plan((p.window(2),))
        assert link.recv(timeout=5) == Stop("done")  # rank 2 had no part in window 8
    finally:
        link.stopping = True
        controller_end.close()
        time.sleep(0.01)
        link.close()
