"""The rig's link model (flodl/rig/links.py): its formulas, its queue, a paced step's timeline,
and real gloo collectives on two processes paying the modelled time for the bytes they move,
on flodl's side and through the DDP communication hook."""

from __future__ import annotations

import statistics
import sys
import threading
import time

import pytest

from flodl.config import ClusterConfig, ConfigError
from flodl.config.cluster import LinkConfig
from flodl.rig import links
from flodl.rig.links import LinkModel, Wire, wire_for
from flodl.rig.pacing import Pacer
from tests.two_ranks import run_two_ranks, write_result

MB = 1_000_000


def test_ring_all_reduce_formula() -> None:
    gbe = wire_for("1gbe")
    assert gbe == Wire(1.0, 0.1, False)
    # 2(N-1)/N x bytes / bandwidth + 2(N-1) x latency
    assert gbe.all_reduce_s(10 * MB, 2) == pytest.approx(10e6 * 8 / 1e9 + 2 * 1e-4)
    assert gbe.all_reduce_s(10 * MB, 3) == pytest.approx(4 / 3 * 10e6 * 8 / 1e9 + 4 * 1e-4)
    assert gbe.all_reduce_s(10 * MB, 1) == 0.0 and gbe.all_reduce_s(0, 4) == 0.0
    # host-staged (no P2P): each hop is a copy down and a copy up
    pcie = wire_for("pcie_no_p2p")
    assert pcie.staged and pcie.all_reduce_s(MB, 2) == pytest.approx(
        2 * MB * 8 / 200e9 + 2 * 0.02e-3
    )
    assert gbe.broadcast_s(MB, 3) == pytest.approx(MB * 8 / 1e9 + 2 * 1e-4)
    assert gbe.transfer_s(MB) == pytest.approx(MB * 8 / 1e9 + 1e-4)


def test_profiles_and_explicit_figures() -> None:
    assert wire_for("none") is None
    assert wire_for("none", bandwidth_gbps=5.0) == Wire(5.0, 0.0, False)
    assert wire_for("10gbe", latency_ms=1.0) == Wire(10.0, 1.0, False)
    with pytest.raises(ValueError, match="unknown link profile '2gbe'"):
        wire_for("2gbe")
    assert ClusterConfig(kind="cpu_rig", link="1gbe").link == LinkConfig(profile="1gbe")
    assert links.model_for_rank(ClusterConfig(kind="cpu_rig"), 0) is None  # none: no charge


@pytest.mark.parametrize(
    "bad",
    ["2gbe", {"profile": "1gbe", "bandwidth_gbps": float("inf")}, {"latency_ms": 1.0}],
)
def test_bad_links_are_refused_with_the_key(bad) -> None:
    from flodl.config import validate_trainer_config

    with pytest.raises(ConfigError, match=r"cluster\.link"):
        validate_trainer_config({"cluster": {"kind": "cpu_rig", "link": bad}})


def test_hosts_cross_the_between_hosts_wire() -> None:
    workers = [
        {"host": "10.0.0.1", "devices": "cpu", "ranks": 2, "ssh": {"target": "a"}},
        {"host": "10.0.0.2", "devices": "cpu", "ranks": 1, "ssh": {"target": "b"}},
    ]
    cluster = ClusterConfig(
        kind="hosts",
        workers=workers,
        controller={"host": "10.0.0.1"},
        link={"profile": "pcie_no_p2p", "between_hosts": "1gbe"},
    )
    local, remote = links.model_for_rank(cluster, 0), links.model_for_rank(cluster, 2)
    assert local is not None and remote is not None
    assert local.wire == remote.wire == wire_for("1gbe")  # the ring crosses the hosts' link
    assert local.controller_wire == wire_for("pcie_no_p2p")  # same host as the controller
    assert remote.controller_wire == wire_for("1gbe")


def test_transfers_queue_on_one_link() -> None:
    """Two 60 ms transfers handed over at once by two threads take 120 ms, not 60."""
    link = LinkModel(Wire(1.0, 0.0))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=link.charge, args=(0.06, 100)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    assert 0.115 < elapsed < 0.2
    assert link.charged_s == pytest.approx(0.12) and link.charged_bytes == 200


def test_a_paced_step_places_its_buckets_on_the_simulated_timeline(monkeypatch) -> None:
    """A bucket launched after 10 ms of a step whose 20 ms of real compute simulate 100 ms
    starts at 50 ms of the simulated step; its 80 ms end at 130 ms: the step lasts 130 ms."""
    clock = iter([100.0, 100.010, 200.0, 200.0])  # open, reserve; open again, (nothing)
    monkeypatch.setattr(links.time, "perf_counter", lambda: next(clock))
    link = LinkModel(Wire(1.0, 0.0))
    link.open_step()
    assert link.reserve(0.08) == 100.010  # in a step: placed when it settles
    assert link.settle_step(real_s=0.02, simulated_s=0.1) == pytest.approx(100.13)
    # a step with nothing on the wire ends at its deadline
    link.open_step()
    assert link.settle_step(real_s=0.01, simulated_s=0.1) == 0.0


def test_a_paced_step_lasts_its_deadline_or_its_transfers(monkeypatch) -> None:
    link = LinkModel(Wire(1.0, 0.0))
    links.install(link)
    try:
        pacer = Pacer(speed=0.5)
        pacer.set_nominal(0.05)  # 100 ms a step at speed 0.5

        def step(transfer_s: float) -> None:
            time.sleep(0.005)
            link.reserve(transfer_s)  # launched at 5 ms of real compute

        for transfer_s, expected in ((0.01, 0.1), (0.2, 0.3)):
            t0 = time.perf_counter()
            pacer.run(lambda t=transfer_s: step(t))
            assert time.perf_counter() - t0 == pytest.approx(expected, abs=0.02)
        assert pacer.overrun_s == 0.0  # the wire's time is the model's, not an overrun
    finally:
        links.install(None)


# -- real collectives: two gloo processes ---------------------------------------------------------

N_FLOATS = 1_000_000  # 4 MB: 320 ms at 0.1 Gbit/s between two ranks (a loopback reduction: ~10)
SLOW = LinkConfig(profile="1gbe", bandwidth_gbps=0.1)


def _collectives(rank: int, rendezvous: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from flodl.runtime.sync.averaging import FlatState, collective_average

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    model = nn.Linear(1000, 1000, bias=False)  # 1 M parameters
    state = FlatState(model)
    gbe = SLOW

    def interleaved(run, link) -> tuple[float, float]:
        """Medians of 5 runs without the link and 5 with it, alternating: a load spike on a
        shared machine lands on both sides, not on the baseline alone."""
        plain, charged = [], []
        for _ in range(5):
            for model, samples in ((None, plain), (link, charged)):
                links.install(model)
                dist.barrier()
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
        links.install(None)
        return statistics.median(plain), statistics.median(charged)

    result = {}
    link = links.model_for(gbe)
    plain, charged = interleaved(lambda: collective_average(state, 0.5, 0.5), link)
    result["flodl"] = {"extra_s": charged - plain, "charged_s": link.charged_s / 5}

    ddp = DistributedDataParallel(model, bucket_cap_mb=100)
    ddp.register_comm_hook(None, links.ddp_comm_hook(2))  # no link installed: DDP's own
    x = torch.randn(4, 1000)

    def backward() -> None:
        ddp(x).sum().backward()

    backward()  # DDP's first iteration builds its buckets
    link = links.model_for(gbe)
    plain, charged = interleaved(backward, link)
    result["ddp"] = {
        "extra_s": charged - plain,
        "charged_s": link.charged_s / 5,
        "bytes": link.charged_bytes / 5,
    }
    write_result(rank, out, result)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_collective_of_known_size_takes_its_modelled_time() -> None:
    result = run_two_ranks("tests.unit.test_rig_links")
    expected = links.model_for(SLOW).wire.all_reduce_s(4 * N_FLOATS, 2)  # 320.2 ms
    flodl, ddp = result["flodl"], result["ddp"]
    assert flodl["charged_s"] == pytest.approx(expected)
    assert flodl["extra_s"] == pytest.approx(expected, rel=0.1)
    # Through the hook: every gradient byte crosses the wire, and the step pays for it.
    assert ddp["bytes"] == 4 * N_FLOATS
    assert ddp["charged_s"] == pytest.approx(expected, rel=0.01)
    assert ddp["extra_s"] == pytest.approx(ddp["charged_s"], rel=0.1)


if __name__ == "__main__":  # one rank of the two-process test above
    _collectives(int(sys.argv[3]), sys.argv[1], sys.argv[2])


def test_each_host_has_its_link_and_a_pair_talks_at_the_slower() -> None:
    """A 10 GbE host beside a 1 GbE one: the ring crosses the slower; a rank on the 10 GbE host
    reaches a controller on the other 10 GbE host at 10 GbE, one on the 1 GbE host at 1 GbE."""
    workers = [
        {"host": "10.0.0.1", "devices": "cpu", "ranks": 1, "ssh": {"target": "a"}, "link": "10gbe"},
        {"host": "10.0.0.2", "devices": "cpu", "ranks": 1, "ssh": {"target": "b"}, "link": "10gbe"},
        {"host": "10.0.0.3", "devices": "cpu", "ranks": 1, "ssh": {"target": "c"}, "link": "1gbe"},
    ]
    cluster = ClusterConfig(
        kind="hosts", workers=workers, controller={"host": "10.0.0.1"}, link="nvlink"
    )
    first, second, third = (links.model_for_rank(cluster, r) for r in range(3))
    assert first.wire == second.wire == third.wire == wire_for("1gbe")  # the ring's slowest
    assert first.controller_wire == wire_for("nvlink")  # the controller's own host
    assert second.controller_wire == wire_for("10gbe")
    assert third.controller_wire == wire_for("1gbe")
    # Without the slow host the ring runs at 10 GbE.
    two = ClusterConfig(
        kind="hosts", workers=workers[:2], controller={"host": "10.0.0.1"}, link="nvlink"
    )
    assert links.model_for_rank(two, 1).wire == wire_for("10gbe")


def test_a_slower_pair_takes_the_lower_bandwidth_and_the_higher_latency() -> None:
    a, b = Wire(10.0, 0.05), Wire(25.0, 0.2, True)
    assert links.slower(a, b) == Wire(10.0, 0.2, True)
    assert links.slower(None, b) == b and links.slower(a, None) == a
