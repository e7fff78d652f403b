"""The scale simulator drives the real controller and ElChe (no copies), covers every epoch
exactly, survives a lost rank, and beats lock-step DDP where speeds differ (no processes)."""

from __future__ import annotations

import math

import pytest

from flodl.runtime.controller import planning
from flodl.sim import RingAllReduce, Simulator, make_scenario
from flodl.sim.costs import Workload, ideal_ms, lockstep_ms


def test_the_simulator_runs_the_controllers_own_planning(monkeypatch):
    """Patch the real planning code: the simulated run must change with it."""
    calls = []
    real = planning.whole_steps

    def spy(counts, accumulate):
        calls.append(list(counts))
        return real(counts, accumulate)

    monkeypatch.setattr(planning, "whole_steps", spy)
    base = Simulator(4, "two_tiers", batches_per_rank=40).run()
    assert calls and all(len(c) == 4 for c in calls)
    assert base.windows == len(calls)  # one ElChe cycle per planned window

    # Every rank forced to one batch per window: many more (lock-step-like) windows.
    one_each = lambda counts, accumulate: [1 if c else 0 for c in counts]  # noqa: E731
    monkeypatch.setattr(planning, "whole_steps", one_each)
    forced = Simulator(4, "two_tiers", batches_per_rank=40).run()
    assert forced.windows > 3 * base.windows
    assert forced.coverage_exact


def test_the_simulator_uses_the_real_elche(monkeypatch):
    from flodl.elche import cadence

    seen = []
    real = cadence.ElChe.report

    def spy(self, compute_ms, batches, sync_ms, **kw):
        seen.append(len(compute_ms))
        return real(self, compute_ms, batches, sync_ms, **kw)

    monkeypatch.setattr(cadence.ElChe, "report", spy)
    res = Simulator(3, "lognormal", batches_per_rank=30).run()
    assert seen == [3] * res.windows


@pytest.mark.parametrize("scenario", ["two_tiers", "lognormal", "straggler", "drift"])
def test_every_epoch_is_covered_exactly(scenario):
    res = Simulator(6, scenario, batches_per_rank=40, epochs=2).run()
    assert res.coverage_exact
    assert res.lost_ranks == []
    assert res.syncs_per_epoch == res.windows / 2
    assert 0.0 < res.efficiency <= 1.0


def test_a_rank_lost_mid_epoch_is_survived_with_exact_coverage():
    sim = Simulator(6, "lost_rank", batches_per_rank=60, epochs=2)
    assert sim.lost_ms < sim.ideal / 2  # mid first epoch
    res = sim.run()
    assert res.lost_ranks == [5]
    assert res.coverage_exact
    assert sim.ctl.members.alive == [True] * 5 + [False]


def test_cadence_beats_lock_step_on_unequal_speeds():
    res = Simulator(8, "two_tiers", batches_per_rank=200).run()
    assert res.lockstep_efficiency < 0.6  # tiers [1.0, 0.4]: lock-step runs at the slow pace
    assert res.efficiency > 0.85
    assert res.efficiency > 1.4 * res.lockstep_efficiency


def test_ring_allreduce_cost_and_the_yardsticks():
    comm = RingAllReduce(alpha_ms=0.1, beta_gb_s=10.0, n_bytes=10**9)
    assert comm.ms(1) == 0.0
    assert comm.ms(2) == pytest.approx(0.1 + 100.0)  # 2·1/2 · 1 GB / 10 GB/s
    assert comm.ms(128) == pytest.approx(0.1 + 2 * 127 / 128 * 100.0)
    work = Workload(base_ms=10.0, batch_size=10, jitter=0.0)
    flat = make_scenario("two_tiers", 2, 1000.0)  # speeds [1.0, 0.4]
    # 1.4 batches per 10 ms: 1400 samples take 1000 ms at the limit.
    assert ideal_ms(1400, flat, 2, work, math.inf) == pytest.approx(1000.0, rel=1e-3)
    free = RingAllReduce(alpha_ms=0.0, n_bytes=0)
    # Lock-step: 2 batches per 25 ms (the slow rank's pace).
    assert lockstep_ms(1400, flat, 2, work, free, math.inf) == pytest.approx(70 * 25.0)


def test_the_simulator_takes_the_rigs_link_model():
    """``RingAllReduce(link=...)`` costs a collective as the rig charges it (flodl/rig/links.py),
    so a simulated 10 GbE cluster and a rig run on ``cluster.link=10gbe`` pay alike."""
    from flodl.rig.links import wire_for

    comm = RingAllReduce(n_bytes=10**8, link="10gbe")
    assert comm.ms(32) == pytest.approx(wire_for("10gbe").all_reduce_s(10**8, 32) * 1e3)
    assert comm.ms(1) == 0.0 and RingAllReduce(n_bytes=10**8, link="none").ms(8) == 0.0
    assert comm.to_dict() == {"n_bytes": 10**8, "link": "10gbe"}
