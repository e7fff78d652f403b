"""ElChe on fake timings: counts, anchor auto-tune, clamps, phases, modes and dispatch queries."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from flodl.config import ElCheConfig, Guard
from flodl.elche import Cycle, ElChe, Phase, Verdict

NEUTRAL = 0.0375  # between overhead_target/2 and overhead_target (0.05): the anchor holds


def step(
    elche: ElChe,
    ms_per_batch: Sequence[float],
    overhead: float = NEUTRAL,
    **kw: float | None,
) -> Cycle:
    """One cycle of a fake rig: each rank ran its planned count at its speed."""
    batches = elche.counts
    compute = [ms * n for ms, n in zip(ms_per_batch, batches, strict=True)]
    return elche.report(compute, batches, overhead * max(compute), **kw)


def quiet(**kw: object) -> ElCheConfig:
    """nccl_cadence without guard/meta side effects unless a test asks for them."""
    return ElCheConfig.nccl_cadence(**{"guard": Guard.NONE, "meta_controller": False, **kw})


def test_uncalibrated_counts_are_the_anchor() -> None:
    elche = ElChe(quiet(anchor=7), 3)
    assert elche.counts == [7, 7, 7]
    assert not elche.calibrated
    assert elche.anchor_rank is None
    assert elche.phase is Phase.PROBE
    assert elche.smoothed_ms == [None, None, None]


def test_speed_hint_is_a_cold_start_prior_for_counts() -> None:
    elche = ElChe(quiet(), 2, speed_hint=[1.0, 0.4])
    assert elche.counts == [25, 10]
    assert elche.fastest_rank() == 0
    assert ElChe(quiet(), 2, speed_hint=[0.4, 1.0]).fastest_rank() == 1


def test_speed_hint_must_match_world() -> None:
    with pytest.raises(ValueError, match="speed_hint"):
        ElChe(quiet(), 2, speed_hint=[1.0])
    with pytest.raises(ValueError, match="speed_hint"):
        ElChe(quiet(), 2, speed_hint=[1.0, 0.0])


def test_rank_two_and_a_half_times_slower_gets_proportional_counts() -> None:
    elche = ElChe(quiet(), 2)
    for _ in range(8):
        cycle = step(elche, [40.0, 100.0])
        fast, slow = cycle.counts
        assert abs(fast - 2.5 * slow) <= 1
    assert elche.anchor_rank == 1
    assert elche.counts == [25, 10]
    assert elche.calibrated
    assert elche.smoothed_ms == [40.0, 100.0]


def test_counts_use_actual_batches_not_planned_ones() -> None:
    elche = ElChe(quiet(), 2)
    # Rank 0 did 30 batches in 600 ms (20 ms/batch), rank 1 did 10 in 1000 ms.
    cycle = elche.report([600.0, 1000.0], [30, 10], 30.0)
    assert cycle.counts == [50, 10]


def test_growth_above_target_at_most_doubles_per_cycle() -> None:
    elche = ElChe(quiet(max_anchor=1000), 2)
    anchors = [step(elche, [10.0, 10.0], overhead=0.5).anchor for _ in range(6)]
    # The first cycle ran in PROBE (no growth); each later one is capped at x2.
    assert anchors == [10, 20, 40, 80, 160, 320]


def test_growth_is_proportional_to_overhead_below_the_cap() -> None:
    elche = ElChe(quiet(), 2)
    for _ in range(5):
        step(elche, [10.0, 10.0])
    assert elche.phase is Phase.STABLE
    cycle = step(elche, [10.0, 10.0], overhead=0.06)
    assert cycle.proposed_anchor == 12  # ceil(10 * 0.06 / 0.05)
    assert cycle.anchor == 12


def test_warmup_grows_only_above_twice_the_target() -> None:
    elche = ElChe(quiet(), 2)
    step(elche, [10.0, 10.0])
    assert elche.phase is Phase.WARMUP
    assert step(elche, [10.0, 10.0], overhead=0.09).anchor == 10
    assert step(elche, [10.0, 10.0], overhead=0.11).anchor == 20


def test_overhead_is_sync_over_slowest_compute() -> None:
    elche = ElChe(quiet(), 2)
    cycle = elche.report([500.0, 1000.0], [10, 10], 50.0)
    assert cycle.overhead == pytest.approx(0.05)


def test_overhead_below_half_target_shrinks_by_one_down_to_min() -> None:
    elche = ElChe(quiet(anchor=10, min_anchor=7), 2)
    anchors = [step(elche, [10.0, 10.0], overhead=0.01).anchor for _ in range(5)]
    assert anchors == [9, 8, 7, 7, 7]


def test_anchor_never_exceeds_max_anchor() -> None:
    elche = ElChe(quiet(anchor=10, max_anchor=30), 2)
    anchors = [step(elche, [10.0, 10.0], overhead=0.5).anchor for _ in range(5)]
    assert anchors == [10, 20, 30, 30, 30]


def test_phases_advance_exactly_at_1_5_20_calibrations() -> None:
    elche = ElChe(quiet(), 2)
    untimed = elche.report([0.0, 0.0], [0, 0], 0.0)
    assert untimed.phase is Phase.PROBE
    phases = [step(elche, [10.0, 10.0]).phase for _ in range(21)]
    assert phases[0] is Phase.WARMUP
    assert phases[3] is Phase.WARMUP
    assert phases[4] is Phase.STABLE
    assert phases[18] is Phase.STABLE
    assert phases[19] is Phase.MATURE
    assert phases[20] is Phase.MATURE


def test_dead_zone_keeps_counts_on_small_jitter() -> None:
    elche = ElChe(quiet(), 2)
    for _ in range(5):
        step(elche, [40.0, 100.0])
    assert elche.counts == [25, 10]
    # 41.67 ms/batch would mean 24 batches: a 4% move, inside the dead zone.
    for _ in range(5):
        step(elche, [41.67, 100.0])
    assert elche.counts == [25, 10]
    # 45.5 ms/batch means 22 batches: a 12% move, taken (it settles within the dead zone).
    for _ in range(5):
        step(elche, [45.5, 100.0])
    fast = elche.counts[0]
    assert fast < 25
    assert abs(fast - 22) <= 0.05 * fast


def test_an_anchor_change_bypasses_the_dead_zone() -> None:
    elche = ElChe(quiet(anchor=20, min_anchor=1), 2)
    for _ in range(3):
        step(elche, [10.0, 10.0])
    cycle = step(elche, [10.0, 10.0], overhead=0.01)
    assert cycle.anchor == 19
    assert cycle.counts == [19, 19]


def test_max_batch_diff_bounds_the_lead_of_the_fastest() -> None:
    elche = ElChe(quiet(max_batch_diff=5), 3)
    for _ in range(3):
        cycle = step(elche, [10.0, 100.0, 50.0])
    assert cycle.counts == [15, 10, 15]
    lockstep = ElChe(quiet(max_batch_diff=0), 2)
    assert step(lockstep, [10.0, 100.0]).counts == [10, 10]


def test_partition_ratios_fix_counts_whatever_the_speed() -> None:
    elche = ElChe(quiet(partition_ratios=[2.0, 1.0, 4.0]), 3)
    assert elche.counts == [20, 10, 40]
    for _ in range(3):
        cycle = step(elche, [100.0, 10.0, 10.0])
    assert cycle.counts == [20, 10, 40]
    with pytest.raises(ValueError, match="partition_ratios"):
        ElChe(quiet(partition_ratios=[1.0, 2.0]), 3)


@pytest.mark.parametrize("preset", [ElCheConfig.nccl_sync, ElCheConfig.cpu_sync])
def test_sync_modes_keep_equal_counts_and_a_fixed_anchor(preset: Callable[[], ElCheConfig]) -> None:
    elche = ElChe(preset(), 2)
    for i in range(25):
        cycle = step(elche, [10.0, 40.0], overhead=0.9, divergence=0.1 * (i + 1), lr=1.0 / (i + 1))
        assert cycle.counts == [1, 1]
        assert cycle.anchor == 1
        assert cycle.verdict is Verdict.STABLE
        assert cycle.meta_factor is None
    assert elche.phase is Phase.MATURE
    assert elche.anchor_rank == 1


def test_relax_up_adds_one_on_stable_cycles_from_stable_phase() -> None:
    elche = ElChe(quiet(relax_up=True), 2)
    anchors = [step(elche, [10.0, 10.0]).anchor for _ in range(7)]
    # Cycles 1-5 ran in PROBE/WARMUP; from the sixth (ran in STABLE) the anchor creeps up.
    assert anchors == [10, 10, 10, 10, 10, 11, 12]


def test_relax_up_honours_max_batch_diff() -> None:
    # Speed ratio 2 with max_batch_diff 10: the anchor may not pass 10 (lead = anchor).
    elche = ElChe(quiet(relax_up=True, max_batch_diff=10, anchor=9), 2)
    anchors = [step(elche, [10.0, 20.0]).anchor for _ in range(8)]
    assert anchors[-1] == 10
    assert max(elche.counts) - min(elche.counts) <= 10


def test_window_never_exceeds_remaining_and_feeds_every_alive_rank() -> None:
    elche = ElChe(quiet(), 3)
    for _ in range(3):
        step(elche, [40.0, 100.0, 20.0])
    assert elche.counts == [25, 10, 50]
    assert elche.window(1000) == [25, 10, 50]
    out = elche.window(30)
    assert sum(out) <= 30
    assert min(out) >= 1
    assert out[2] >= out[0] >= out[1]
    assert elche.window(2) == [1, 0, 1]  # fastest ranks first
    assert elche.window(0) == [0, 0, 0]


def test_window_gives_dead_ranks_nothing() -> None:
    elche = ElChe(quiet(), 3)
    step(elche, [40.0, 100.0, 20.0])
    assert elche.window(1000, alive=[True, False, True]) == [25, 0, 50]
    assert elche.window(1, alive=[True, False, False]) == [1, 0, 0]
    with pytest.raises(ValueError, match="alive"):
        elche.window(10, alive=[True])
    with pytest.raises(ValueError, match="remaining_batches"):
        elche.window(-1)


def test_fastest_rank_uses_smoothed_speed_and_skips_dead() -> None:
    elche = ElChe(quiet(), 3)
    assert elche.fastest_rank() == 0
    step(elche, [40.0, 20.0, 20.0])
    assert elche.fastest_rank() == 1  # tie between 1 and 2: lowest index
    assert elche.fastest_rank(alive=[True, False, True]) == 2
    with pytest.raises(ValueError, match="no rank is alive"):
        elche.fastest_rank(alive=[False, False, False])


def test_batch_share_is_the_mean_of_recent_snapshots() -> None:
    elche = ElChe(quiet(), 2)
    assert elche.batch_share() == [0.5, 0.5]
    step(elche, [10.0, 30.0])  # counts [30, 10]
    assert elche.batch_share() == pytest.approx([0.75, 0.25])
    recent = [step(elche, [10.0, 10.0 + i]).counts for i in range(12)][-10:]
    totals = [sum(row[r] for row in recent) for r in range(2)]
    assert elche.batch_share() == pytest.approx([t / sum(totals) for t in totals])
    assert sum(elche.batch_share()) == pytest.approx(1.0)


def test_solo_world_of_one() -> None:
    elche = ElChe(ElCheConfig.solo(), 1)
    cycle = step(elche, [10.0])
    assert cycle.counts == [10]
    assert cycle.anchor_rank == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1.0], [1, 1], 1.0), "world_size=2"),
        (([1.0, -1.0], [1, 1], 1.0), "compute_ms"),
        (([1.0, float("nan")], [1, 1], 1.0), "compute_ms"),
        (([1.0, 1.0], [1, -1], 1.0), "batches"),
        (([1.0, 1.0], [1, 1.5], 1.0), "batches"),
        (([1.0, 1.0], [1, 1], -1.0), "sync_ms"),
    ],
)
def test_bad_reports_are_refused_without_side_effects(args: tuple, match: str) -> None:
    elche = ElChe(quiet(), 2)
    before = elche.state()
    with pytest.raises(ValueError, match=match):
        elche.report(*args)
    assert elche.state() == before


def test_bad_divergence_or_lr_is_refused() -> None:
    elche = ElChe(quiet(), 2)
    with pytest.raises(ValueError, match="divergence"):
        elche.report([1.0, 1.0], [1, 1], 0.0, divergence=float("inf"))
    with pytest.raises(ValueError, match="lr"):
        elche.report([1.0, 1.0], [1, 1], 0.0, lr=-0.1)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        ElChe(quiet(), 0)
