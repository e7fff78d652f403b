"""Convergence guards alone and as ElChe's final say on the anchor proposal."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flodl.config import ElCheConfig, Guard
from flodl.elche import (
    Cycle,
    ElChe,
    MsfGuard,
    NoGuard,
    Phase,
    TrendGuard,
    Verdict,
    make_guard,
)

NEUTRAL = 0.0375


def step(elche: ElChe, overhead: float = NEUTRAL, divergence: float | None = None) -> Cycle:
    batches = elche.counts
    compute = [10.0 * n for n in batches]
    return elche.report(compute, batches, overhead * max(compute), divergence=divergence)


def verdicts(guard: TrendGuard | MsfGuard | NoGuard, series: Sequence[float]) -> list[Verdict]:
    return [guard.observe(d).verdict for d in series]


S, G, N = Verdict.STABLE, Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN


def test_trend_guard_suppresses_three_rises_above_threshold() -> None:
    assert verdicts(TrendGuard(0.05), [0.06, 0.07, 0.08, 0.09, 0.05]) == [S, S, G, G, S]


def test_trend_guard_ignores_rises_below_threshold_and_plateaus() -> None:
    assert verdicts(TrendGuard(0.05), [0.01, 0.02, 0.03, 0.04]) == [S] * 4
    assert verdicts(TrendGuard(0.05), [0.06, 0.07, 0.07, 0.08]) == [S] * 4


def test_guards_keep_a_ring_of_five() -> None:
    guard = TrendGuard(0.05)
    verdicts(guard, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert guard.memory.history == [0.3, 0.4, 0.5, 0.6, 0.7]


def test_no_guard_is_always_stable() -> None:
    guard = NoGuard()
    assert verdicts(guard, [0.1, 0.2, 0.4, 0.8, 1.6]) == [S] * 5
    assert guard.memory.history == [0.1, 0.2, 0.4, 0.8, 1.6]


def test_msf_guard_nudges_down_on_fast_sustained_growth() -> None:
    guard = MsfGuard()
    series = [0.01 * 1.1**i for i in range(7)]  # rate ln 1.1 ~ 0.095 per event
    decisions = [guard.observe(d) for d in series]
    assert [d.verdict for d in decisions] == [S, S, S, N, G, G, N]
    assert decisions[3].nudge_factor == 0.5


def test_msf_guard_suppresses_slow_sustained_growth() -> None:
    series = [0.01 * 1.005**i for i in range(6)]  # rate ~0.005: above 1e-3, below 1e-2
    assert verdicts(MsfGuard(), series) == [S, S, S, G, G, G]


def test_msf_guard_is_stable_while_divergence_shrinks() -> None:
    assert verdicts(MsfGuard(), [0.1 * 0.9**i for i in range(8)]) == [S] * 8


def test_msf_guard_resets_below_noise_floor() -> None:
    guard = MsfGuard()
    verdicts(guard, [0.01, 0.011, 0.0121])
    assert guard.memory.msf_events == 2
    assert guard.observe(1e-9).verdict is S
    mem = guard.memory
    assert (mem.msf_ema, mem.msf_events, mem.msf_suppress_run, mem.msf_nudge_run) == (0.0, 0, 0, 0)


def test_guard_rejects_bad_divergence() -> None:
    with pytest.raises(ValueError, match="divergence"):
        TrendGuard(0.05).observe(-0.1)
    with pytest.raises(ValueError, match="threshold"):
        TrendGuard(0.0)


def test_make_guard_follows_config() -> None:
    trend = make_guard(ElCheConfig())
    assert isinstance(trend, TrendGuard) and trend.threshold == 0.05
    easgd = make_guard(ElCheConfig.cpu_async())
    assert isinstance(easgd, TrendGuard) and easgd.threshold == 0.3
    custom = make_guard(ElCheConfig(divergence_threshold=0.2))
    assert isinstance(custom, TrendGuard) and custom.threshold == 0.2
    assert isinstance(make_guard(ElCheConfig(guard=Guard.MSF)), MsfGuard)
    assert isinstance(make_guard(ElCheConfig(guard=Guard.NONE)), NoGuard)


def stable_elche(**kw: object) -> ElChe:
    """An ElChe that has reached the STABLE phase on neutral cycles."""
    elche = ElChe(ElCheConfig.nccl_cadence(**{"meta_controller": False, **kw}), 2)
    for _ in range(5):
        step(elche)
    assert elche.phase is Phase.STABLE
    return elche


def test_rising_divergence_vetoes_growth_and_five_clean_verdicts_rearm() -> None:
    elche = stable_elche()
    step(elche, divergence=0.06)
    step(elche, divergence=0.07)
    vetoed = step(elche, overhead=0.5, divergence=0.08)
    assert vetoed.verdict is Verdict.SUPPRESS_GROWTH
    assert vetoed.proposed_anchor == 20
    assert vetoed.anchor == 10
    assert elche.state().growth_latched_off
    latched = [step(elche, overhead=0.5, divergence=0.01) for _ in range(4)]
    assert all(c.verdict is Verdict.STABLE and c.anchor == 10 for c in latched)
    rearmed = step(elche, overhead=0.5, divergence=0.01)
    assert rearmed.anchor == 20
    assert not elche.state().growth_latched_off


def test_suppression_still_lets_the_anchor_shrink() -> None:
    elche = stable_elche(min_anchor=1)
    step(elche, divergence=0.06)
    step(elche, divergence=0.07)
    cycle = step(elche, overhead=0.01, divergence=0.08)
    assert cycle.verdict is Verdict.SUPPRESS_GROWTH
    assert cycle.anchor == 9


def test_msf_nudge_halves_the_anchor_even_below_min_anchor() -> None:
    elche = stable_elche(guard=Guard.MSF)
    cycles = [step(elche, overhead=0.5, divergence=0.01 * 1.1**i) for i in range(4)]
    assert [c.anchor for c in cycles[:3]] == [20, 40, 80]
    nudged = cycles[3]
    assert nudged.verdict is Verdict.NUDGE_DOWN
    assert nudged.proposed_anchor == 160
    assert nudged.anchor == 40  # ceil(80 * 0.5); the growth proposal was dropped


def test_nudge_can_take_the_anchor_under_min_but_not_under_one() -> None:
    elche = stable_elche(guard=Guard.MSF, anchor=1)
    divergence = 0.01
    for _ in range(12):
        divergence *= 1.2
        cycle = step(elche, divergence=divergence)
        assert cycle.anchor >= 1
    elche2 = stable_elche(guard=Guard.MSF, anchor=10)
    divergence = 0.01
    anchors = []
    for _ in range(4):
        divergence *= 1.2
        anchors.append(step(elche2, divergence=divergence).anchor)
    assert anchors[-1] == 5  # under min_anchor (10)


def test_unknown_divergence_is_stable_and_not_recorded() -> None:
    elche = stable_elche()
    step(elche, divergence=0.06)
    cycle = step(elche, overhead=0.5)
    assert cycle.verdict is Verdict.STABLE
    assert cycle.divergence is None
    assert elche.state().trend_history == [0.06]
