"""Meta-controller: LR cliffs and streaks of bad verdicts shrink the anchor."""

from __future__ import annotations

import pytest

from flodl.config import ElCheConfig, Guard
from flodl.elche import Cycle, ElChe, MetaController, Phase, Verdict

S, G, N = Verdict.STABLE, Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN


def step(elche: ElChe, **kw: float | None) -> Cycle:
    batches = elche.counts
    compute = [10.0 * n for n in batches]
    return elche.report(compute, batches, 0.0375 * max(compute), **kw)


def test_lr_cliff_halves_the_anchor() -> None:
    elche = ElChe(ElCheConfig.nccl_cadence(guard=Guard.NONE), 2)
    step(elche, lr=0.1)
    assert step(elche, lr=0.1).meta_factor is None
    assert step(elche, lr=0.075).meta_factor is None  # a 25% drop is no cliff
    cliff = step(elche, lr=0.01)
    assert cliff.meta_factor == 0.5
    assert cliff.anchor == 5  # bypasses min_anchor (10)
    assert step(elche, lr=0.01).meta_factor is None


def test_meta_controller_can_be_switched_off() -> None:
    elche = ElChe(ElCheConfig.nccl_cadence(meta_controller=False), 2)
    step(elche, lr=0.1)
    step(elche, lr=0.1)
    assert step(elche, lr=0.001).meta_factor is None
    assert elche.anchor == 10


def test_silent_in_probe_but_still_tracks_lr() -> None:
    meta = MetaController(enabled=True)
    assert meta.observe(Phase.PROBE, S, 1.0) is None
    assert meta.observe(Phase.PROBE, S, 0.1) is None
    assert meta.last_lr == 0.1
    assert meta.observe(Phase.WARMUP, S, 0.1) is None
    assert meta.observe(Phase.WARMUP, S, 0.01) == 0.5


def test_missing_lr_keeps_the_reference() -> None:
    meta = MetaController(enabled=True)
    meta.observe(Phase.WARMUP, S, 1.0)
    assert meta.observe(Phase.WARMUP, S, None) is None
    assert meta.observe(Phase.WARMUP, S, 0.5) == 0.5


@pytest.mark.parametrize(
    ("phase", "length", "factor"),
    [(Phase.WARMUP, 5, 0.3), (Phase.STABLE, 3, 0.5), (Phase.MATURE, 2, 0.7)],
)
def test_bad_streak_length_and_factor_depend_on_phase(
    phase: Phase, length: int, factor: float
) -> None:
    meta = MetaController(enabled=True)
    fired = [meta.observe(phase, G if i % 2 else N, None) for i in range(length)]
    assert fired[:-1] == [None] * (length - 1)
    assert fired[-1] == factor
    # The streak starts afresh after firing.
    again = [meta.observe(phase, G, None) for _ in range(length)]
    assert again[-1] == factor
    assert again[:-1] == [None] * (length - 1)


def test_a_stable_verdict_breaks_the_streak() -> None:
    meta = MetaController(enabled=True)
    assert [meta.observe(Phase.STABLE, v, None) for v in (G, G, S, G, G)] == [None] * 5


def test_cliff_and_streak_together_multiply() -> None:
    meta = MetaController(enabled=True, last_lr=1.0)
    assert meta.observe(Phase.MATURE, G, None) is None
    assert meta.observe(Phase.MATURE, G, 0.1) == pytest.approx(0.35)


def test_meta_rejects_bad_lr() -> None:
    with pytest.raises(ValueError, match="lr"):
        MetaController(enabled=True).observe(Phase.STABLE, S, float("nan"))


def test_streak_of_guard_vetoes_shrinks_the_anchor_through_elche() -> None:
    elche = ElChe(ElCheConfig.nccl_cadence(), 2)
    for _ in range(5):
        step(elche)
    assert elche.phase is Phase.STABLE
    cycles = [step(elche, divergence=0.06 + 0.01 * i) for i in range(5)]
    # Suppressions start at the third rising divergence; three of them in STABLE fire x0.5.
    assert [c.verdict for c in cycles] == [S, S, G, G, G]
    assert [c.meta_factor for c in cycles] == [None, None, None, None, 0.5]
    assert cycles[-1].anchor == 5
