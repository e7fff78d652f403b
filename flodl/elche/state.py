"""ElChe's records: phases, the per-cycle decision, and the resumable state.

:class:`ElCheState` is everything a resumed controller needs to continue exactly where it left
off. It round-trips through a plain JSON-able dict (checkpoint ``meta.json``); :meth:`from_dict`
refuses malformed input with a message that names the key, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

from flodl.elche.guard import HISTORY_LEN, Verdict
from flodl.elche.speed import TRUST_WINDOW

#: Calibrations at which the phase advances to WARMUP, STABLE and MATURE.
WARMUP_AT, STABLE_AT, MATURE_AT = 1, 5, 20
#: Batch-count snapshots kept for :meth:`ElChe.batch_share`.
SHARE_WINDOW = 10
#: Verdicts kept for the meta-controller (its longest streak length).
VERDICT_HISTORY = 5


class Phase(str, Enum):
    """How much ElChe knows, by calibration count; gates election, growth and relax_up."""

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    @property
    def level(self) -> int:
        """Order of the phase (PROBE 0 .. MATURE 3); compare phases with this, not as strings."""
        return list(Phase).index(self)


def phase_for(calibrations: int) -> Phase:
    """The phase reached after ``calibrations`` timed reports."""
    if calibrations >= MATURE_AT:
        return Phase.MATURE
    if calibrations >= STABLE_AT:
        return Phase.STABLE
    if calibrations >= WARMUP_AT:
        return Phase.WARMUP
    return Phase.PROBE


@dataclass(frozen=True)
class Cycle:
    """What one :meth:`ElChe.report` decided.

    ``anchor``/``counts``/``phase``/``anchor_rank`` are the values for the next window;
    ``proposed_anchor`` is the cadence proposal before the guard and meta-controller had their
    say; ``meta_factor`` is the factor the meta-controller applied (None when it did not fire).
    """

    anchor: int
    counts: list[int]
    overhead: float
    verdict: Verdict
    phase: Phase
    proposed_anchor: int
    divergence: float | None
    anchor_rank: int | None
    meta_factor: float | None


@dataclass
class ElCheState:
    """Everything needed to resume an :class:`ElChe` (see module doc).

    ``smoothed_ms_per_batch`` is derived from ``speed_windows`` and kept for readers of the
    checkpoint; ``trend_history`` and the ``msf_*`` fields are the convergence guard's memory;
    ``verdict_history`` and ``last_lr`` are the meta-controller's.
    """

    anchor: int
    anchor_rank: int | None
    smoothed_ms_per_batch: list[float | None]
    phase: Phase
    calibration_count: int
    trend_history: list[float]
    counts: list[int]
    growth_latched_off: bool
    clean_verdicts: int
    speed_windows: list[list[float]]
    zero_streaks: list[int]
    msf_ema: float
    msf_events: int
    msf_suppress_run: int
    msf_nudge_run: int
    verdict_history: list[Verdict]
    last_lr: float | None
    counts_history: list[list[int]]

    @property
    def world_size(self) -> int:
        """Number of ranks this state describes."""
        return len(self.counts)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of JSON types (enums as their string values)."""
        out = asdict(self)
        out["phase"] = self.phase.value
        out["verdict_history"] = [v.value for v in self.verdict_history]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ElCheState:
        """Parse and validate a dict written by :meth:`to_dict`; ValueError on bad input.

        Only the core keys (anchor, anchor_rank, smoothed_ms_per_batch, phase,
        calibration_count, trend_history, counts) are required; the rest default to a fresh
        controller's values, with the trust windows seeded from the smoothed speeds.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"ElCheState: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ElCheState: unknown keys {unknown} (allowed: {sorted(known)})")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"ElCheState: missing required keys {missing}")
        values = {k: _PARSERS[k](k, d[k]) for k in known if k in d}
        smoothed = values["smoothed_ms_per_batch"]
        world = len(smoothed)
        defaults: dict[str, Any] = {
            "growth_latched_off": False,
            "clean_verdicts": 0,
            "speed_windows": [[ms] if ms is not None else [] for ms in smoothed],
            "zero_streaks": [0] * world,
            "msf_ema": 0.0,
            "msf_events": 0,
            "msf_suppress_run": 0,
            "msf_nudge_run": 0,
            "verdict_history": [],
            "last_lr": None,
            "counts_history": [],
        }
        state = cls(**{**defaults, **values})
        state.validate()
        return state

    def validate(self, world_size: int | None = None) -> None:
        """Check cross-field consistency (lengths, ranges, phase vs calibrations)."""
        world = len(self.counts)
        if world < 1:
            raise ValueError("ElCheState.counts=[]: needs one entry per rank")
        if world_size is not None and world != world_size:
            raise ValueError(
                f"ElCheState describes {world} ranks but world_size={world_size}: "
                "resume with the world size the state was saved with"
            )
        for key in ("smoothed_ms_per_batch", "speed_windows", "zero_streaks"):
            if len(getattr(self, key)) != world:
                raise ValueError(f"ElCheState.{key}: needs {world} entries (one per rank)")
        bad_rows = [row for row in self.counts_history if len(row) != world]
        if bad_rows:
            raise ValueError(f"ElCheState.counts_history={bad_rows[0]}: needs {world} entries")
        if self.anchor_rank is not None and not 0 <= self.anchor_rank < world:
            raise ValueError(f"ElCheState.anchor_rank={self.anchor_rank}: must be in [0, {world})")
        expected = phase_for(self.calibration_count)
        if self.phase is not expected:
            raise ValueError(
                f"ElCheState.phase={self.phase.value}: calibration_count="
                f"{self.calibration_count} means phase {expected.value}"
            )


# --- field parsers: each takes (key, raw value) and returns the typed value or raises ---------


def _fail(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"ElCheState.{key}={value!r}: {allowed}")


def _int(lo: int) -> Callable[[str, Any], int]:
    def parse(key: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise _fail(key, v, f"must be an integer >= {lo}")
        return v

    return parse


def _float(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(key, v, "must be a finite number")
    return float(v)


def _nonneg_float(key: str, v: Any) -> float:
    out = _float(key, v)
    if out < 0:
        raise _fail(key, v, "must be >= 0")
    return out


def _optional(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda key, v: None if v is None else parse(key, v)


def _list(
    parse: Callable[[str, Any], Any], max_len: int | None = None
) -> Callable[[str, Any], list[Any]]:
    def parse_list(key: str, v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise _fail(key, v, "must be a list")
        if max_len is not None and len(v) > max_len:
            raise _fail(key, v, f"must have at most {max_len} entries")
        return [parse(f"{key}[{i}]", x) for i, x in enumerate(v)]

    return parse_list


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(key, v, "must be true or false")
    return v


def _enum(cls: type[Enum]) -> Callable[[str, Any], Any]:
    def parse(key: str, v: Any) -> Any:
        try:
            return cls(v)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in cls)
            raise _fail(key, v, f"must be one of {allowed}") from None

    return parse


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "anchor": _int(1),
    "anchor_rank": _optional(_int(0)),
    "smoothed_ms_per_batch": _list(_optional(_nonneg_float)),
    "phase": _enum(Phase),
    "calibration_count": _int(0),
    "trend_history": _list(_nonneg_float, HISTORY_LEN),
    "counts": _list(_int(1)),
    "growth_latched_off": _bool,
    "clean_verdicts": _int(0),
    "speed_windows": _list(_list(_nonneg_float, TRUST_WINDOW)),
    "zero_streaks": _list(_int(0)),
    "msf_ema": _float,
    "msf_events": _int(0),
    "msf_suppress_run": _int(0),
    "msf_nudge_run": _int(0),
    "verdict_history": _list(_enum(Verdict), VERDICT_HISTORY),
    "last_lr": _optional(_nonneg_float),
    "counts_history": _list(_list(_int(1)), SHARE_WINDOW),
}
_REQUIRED = (
    "anchor",
    "anchor_rank",
    "smoothed_ms_per_batch",
    "phase",
    "calibration_count",
    "trend_history",
    "counts",
)
