"""ElCheState: JSON round-trip, validation, and identical behaviour after a resume."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flodl.config import ElCheConfig, Guard
from flodl.elche import Cycle, ElChe, ElCheState, Phase, Verdict


def drive(elche: ElChe, start: int, stop: int) -> list[Cycle]:
    """Deterministic but varied reports: jittery speeds, wandering overhead, divergence, LR."""
    cycles = []
    for i in range(start, stop):
        speeds = [20.0 + (i * 7) % 5, 50.0 + (i * 3) % 11, 33.0 + (i % 4)]
        batches = elche.counts
        if i % 9 == 4:
            batches = [0, *batches[1:]]  # an idle rank now and then
        compute = [ms * n for ms, n in zip(speeds, batches, strict=True)]
        overhead = (0.01, 0.04, 0.12, 0.3)[i % 4]
        divergence = None if i % 6 == 5 else 0.04 * (1.0 + 0.2 * (i % 5))
        lr = 0.1 if i < 14 else 0.01
        cycles.append(elche.report(compute, batches, overhead * max(compute), divergence, lr))
    return cycles


def roundtrip(state: ElCheState) -> ElCheState:
    return ElCheState.from_dict(json.loads(json.dumps(state.to_dict())))


CONFIGS = [
    ElCheConfig.nccl_cadence(),
    ElCheConfig.nccl_cadence(guard=Guard.MSF, relax_up=True, max_batch_diff=40),
    ElCheConfig.cpu_async(anchor=4, min_anchor=2),
    ElCheConfig.cpu_sync(),
    ElCheConfig.cpu_cadence(partition_ratios=[1.0, 2.0, 3.0]),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.mode.value)
@pytest.mark.parametrize("split", [0, 1, 6, 17])
def test_resumed_controller_makes_identical_decisions(config: ElCheConfig, split: int) -> None:
    original = ElChe(config, 3)
    drive(original, 0, split)
    resumed = ElChe(config, 3, state=roundtrip(original.state()))
    assert resumed.state() == original.state()
    cycles = drive(original, split, 30)
    assert drive(resumed, split, 30) == cycles
    assert resumed.state() == original.state()
    assert resumed.window(17, [True, False, True]) == original.window(17, [True, False, True])
    assert resumed.batch_share() == original.batch_share()
    assert resumed.fastest_rank() == original.fastest_rank()


def test_drive_exercises_guard_and_meta() -> None:
    cycles = drive(ElChe(ElCheConfig.nccl_cadence(), 3), 0, 30)
    assert {c.verdict for c in cycles} == {Verdict.STABLE, Verdict.SUPPRESS_GROWTH}
    assert any(c.meta_factor is not None for c in cycles)
    msf = drive(ElChe(ElCheConfig.nccl_cadence(guard=Guard.MSF), 3), 0, 30)
    assert Verdict.NUDGE_DOWN in {c.verdict for c in msf}


def test_state_round_trips_through_json() -> None:
    elche = ElChe(ElCheConfig.nccl_cadence(guard=Guard.MSF), 3)
    drive(elche, 0, 25)
    state = elche.state()
    assert state.phase is Phase.MATURE
    assert state.msf_events > 0
    assert roundtrip(state) == state
    as_dict = state.to_dict()
    assert as_dict["phase"] == "mature"
    assert all(isinstance(v, str) for v in as_dict["verdict_history"])


def test_state_is_a_detached_snapshot() -> None:
    elche = ElChe(ElCheConfig(), 2)
    state = elche.state()
    state.counts[0] = 999
    state.trend_history.append(1.0)
    assert elche.counts == [10, 10]
    assert elche.state().trend_history == []


def test_minimal_dict_seeds_trust_windows_from_smoothed_speeds() -> None:
    minimal = {
        "anchor": 12,
        "anchor_rank": 1,
        "smoothed_ms_per_batch": [40.0, 100.0],
        "phase": "stable",
        "calibration_count": 7,
        "trend_history": [0.01, 0.02],
        "counts": [30, 12],
    }
    state = ElCheState.from_dict(minimal)
    assert state.speed_windows == [[40.0], [100.0]]
    elche = ElChe(ElCheConfig(), 2, state=state)
    assert elche.anchor == 12
    assert elche.smoothed_ms == [40.0, 100.0]
    assert elche.phase is Phase.STABLE


def good_dict() -> dict[str, Any]:
    elche = ElChe(ElCheConfig(), 2)
    drive_two(elche)
    return elche.state().to_dict()


def drive_two(elche: ElChe) -> None:
    for _ in range(6):
        batches = elche.counts
        elche.report([40.0 * batches[0], 100.0 * batches[1]], batches, 10.0, 0.01, 0.1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"anchor": 0}, r"anchor=0: must be an integer >= 1"),
        ({"anchor": "10"}, r"anchor='10'"),
        ({"anchor": True}, r"anchor=True"),
        ({"anchor_rank": 2}, r"anchor_rank=2: must be in \[0, 2\)"),
        ({"phase": "fast"}, r"phase='fast': must be one of probe, warmup, stable, mature"),
        ({"phase": "mature"}, r"calibration_count=6 means phase stable"),
        ({"counts": [10]}, r"needs 1 ranks|smoothed_ms_per_batch: needs 1 entries"),
        ({"counts": [0, 10]}, r"counts\[0\]=0"),
        ({"trend_history": [0.1] * 6}, r"at most 5 entries"),
        ({"smoothed_ms_per_batch": [-1.0, 2.0]}, r"smoothed_ms_per_batch\[0\]=-1.0: must be >= 0"),
        ({"verdict_history": ["bad"]}, r"verdict_history\[0\]='bad'"),
        ({"last_lr": float("nan")}, r"last_lr=nan: must be a finite number"),
        ({"growth_latched_off": 1}, r"growth_latched_off=1: must be true or false"),
        ({"counts_history": [[1, 2, 3]]}, r"counts_history=\[1, 2, 3\]: needs 2 entries"),
        ({"surprise": 1}, r"unknown keys \['surprise'\]"),
    ],
)
def test_from_dict_refuses_bad_input_with_a_clear_message(
    change: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ElCheState.from_dict({**good_dict(), **change})


def test_from_dict_requires_core_keys_and_a_mapping() -> None:
    data = good_dict()
    del data["anchor"]
    with pytest.raises(ValueError, match=r"missing required keys \['anchor'\]"):
        ElCheState.from_dict(data)
    with pytest.raises(ValueError, match="expected a mapping"):
        ElCheState.from_dict([1, 2])  # type: ignore[arg-type]


def test_resume_with_another_world_size_is_refused() -> None:
    state = ElCheState.from_dict(good_dict())
    with pytest.raises(ValueError, match="resume with the world size"):
        ElChe(ElCheConfig(), 3, state=state)


def test_resume_honours_a_lower_max_anchor() -> None:
    data = good_dict()
    data["anchor"] = 500
    elche = ElChe(ElCheConfig(max_anchor=100), 2, state=ElCheState.from_dict(data))
    assert elche.anchor == 100
