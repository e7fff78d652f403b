"""Invariants of ElChe and the weight helpers under arbitrary (hypothesis-generated) input."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.config import ElCheConfig, Guard, Mode
from flodl.elche import (
    Cycle,
    ElChe,
    ElCheState,
    Verdict,
    averaging_weights,
    buffer_weights,
    phase_for,
)

MODES = [Mode.NCCL_CADENCE, Mode.CPU_CADENCE, Mode.CPU_ASYNC, Mode.NCCL_SYNC, Mode.CPU_SYNC]


@dataclass(frozen=True)
class Report:
    speeds: list[float]  # ms per batch per rank
    idle: list[bool]  # ranks that did no batch this cycle
    overhead: float
    divergence: float | None
    lr: float | None


@st.composite
def configs(draw: st.DrawFn, world: int) -> ElCheConfig:
    max_anchor = draw(st.integers(1, 300))
    ratios = draw(st.none() | st.lists(st.floats(0.1, 10.0), min_size=world, max_size=world))
    return ElCheConfig(
        mode=draw(st.sampled_from(MODES)),
        anchor=draw(st.integers(1, max_anchor)),
        min_anchor=draw(st.none() | st.integers(1, max_anchor)),
        max_anchor=max_anchor,
        overhead_target=draw(st.floats(0.01, 0.5)),
        max_batch_diff=draw(st.none() | st.integers(0, 30)),
        relax_up=draw(st.booleans()),
        partition_ratios=ratios,
        meta_controller=draw(st.booleans()),
        guard=draw(st.sampled_from(list(Guard))),
    )


def reports(world: int) -> st.SearchStrategy[list[Report]]:
    report = st.builds(
        Report,
        speeds=st.lists(st.floats(0.0, 500.0), min_size=world, max_size=world),
        idle=st.lists(st.booleans(), min_size=world, max_size=world),
        overhead=st.floats(0.0, 3.0),
        divergence=st.none() | st.floats(0.0, 2.0),
        lr=st.none() | st.floats(0.0, 1.0),
    )
    return st.lists(report, min_size=1, max_size=40)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, ElCheConfig, list[Report], list[float] | None]:
    world = draw(st.integers(1, 5))
    hint = draw(st.none() | st.lists(st.floats(0.05, 1.0), min_size=world, max_size=world))
    return world, draw(configs(world)), draw(reports(world)), hint


def feed(elche: ElChe, report: Report) -> Cycle:
    batches = [0 if idle else n for idle, n in zip(report.idle, elche.counts, strict=True)]
    compute = [ms * n for ms, n in zip(report.speeds, batches, strict=True)]
    sync = report.overhead * max(compute)
    return elche.report(compute, batches, sync, report.divergence, report.lr)


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_cycle_invariants(
    scenario: tuple[int, ElCheConfig, list[Report], list[float] | None],
) -> None:
    world, config, series, hint = scenario
    elche = ElChe(config, world, speed_hint=hint)
    floor = min(config.effective_min_anchor, config.anchor)
    cut = False  # NudgeDown or the meta-controller may take the anchor under min_anchor
    for report in series:
        before = elche.anchor
        cycle = feed(elche, report)
        cut = cut or cycle.verdict is Verdict.NUDGE_DOWN or cycle.meta_factor is not None
        assert len(cycle.counts) == world
        assert min(cycle.counts) >= 1
        assert 1 <= cycle.anchor <= config.max_anchor
        assert cut or cycle.anchor >= floor
        assert cycle.anchor <= 2 * before + 1  # x2 growth, plus relax_up's +1
        assert cycle.phase is phase_for(elche.state().calibration_count)
        if config.max_batch_diff is not None:
            assert max(cycle.counts) - min(cycle.counts) <= config.max_batch_diff
        if config.mode.policy.lock_step:
            assert cycle.counts == [config.anchor] * world
            assert cycle.anchor == config.anchor
        assert math.isclose(sum(elche.batch_share()), 1.0)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(0, 3000), st.data())
def test_window_fits_the_epoch(
    scenario: tuple[int, ElCheConfig, list[Report], list[float] | None],
    remaining: int,
    data: st.DataObject,
) -> None:
    world, config, series, hint = scenario
    elche = ElChe(config, world, speed_hint=hint)
    for report in series:
        feed(elche, report)
    alive = data.draw(st.lists(st.booleans(), min_size=world, max_size=world))
    out = elche.window(remaining, alive)
    assert sum(out) <= remaining
    assert all(0 <= n <= planned for n, planned in zip(out, elche.counts, strict=True))
    assert all(n == 0 for n, up in zip(out, alive, strict=True) if not up)
    n_alive = sum(alive)
    if remaining >= n_alive:
        assert all(n >= 1 for n, up in zip(out, alive, strict=True) if up)
    else:
        assert sum(out) == remaining
    if n_alive:
        assert alive[elche.fastest_rank(alive)]


@settings(max_examples=80, deadline=None)
@given(scenarios(), st.data())
def test_resume_at_any_point_is_indistinguishable(
    scenario: tuple[int, ElCheConfig, list[Report], list[float] | None], data: st.DataObject
) -> None:
    world, config, series, hint = scenario
    split = data.draw(st.integers(0, len(series)))
    original = ElChe(config, world, speed_hint=hint)
    for report in series[:split]:
        feed(original, report)
    saved = json.loads(json.dumps(original.state().to_dict()))
    resumed = ElChe(config, world, state=ElCheState.from_dict(saved), speed_hint=hint)
    for report in series[split:]:
        assert feed(resumed, report) == feed(original, report)
    assert resumed.state() == original.state()


batch_lists = st.lists(st.integers(0, 10**6), min_size=1, max_size=16).filter(any)


@given(batch_lists, st.floats(-1.0, 4.0))
def test_averaging_weights_sum_to_one_and_skip_idle_ranks(batches: list[int], gamma: float) -> None:
    weights = averaging_weights(batches, gamma)
    assert math.isclose(sum(weights), 1.0)
    assert all(w >= 0 for w in weights)
    assert all((w > 0) == (b > 0) for w, b in zip(weights, batches, strict=True))


@given(batch_lists)
def test_buffer_weights_sum_to_one(batches: list[int]) -> None:
    weights = buffer_weights(batches)
    assert math.isclose(sum(weights), 1.0)
    assert len({w for w, b in zip(weights, batches, strict=True) if b > 0}) == 1
