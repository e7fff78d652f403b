"""Messages of the control plane. Plain frozen dataclasses: pickled only after authentication."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Chunk = tuple[int, int]  # (offset, size) into the epoch's permutation


@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class Ready:
    """The rank built its model, joined the data plane and calibrated its pacing."""

    rank: int
    signature: str  # architecture fingerprint: names, shapes and dtypes of the state
    n_params: int
    step_ms: float
    device: str
    n_samples: int


@dataclass(frozen=True)
class Window:
    """One averaging window for one rank: the chunks it trains, then its averaging weights."""

    index: int
    epoch: int
    chunks: tuple[Chunk, ...]
    weight: float  # this rank's share of the parameter average
    buffer_weight: float  # this rank's share of the float-buffer average
    eval_after: bool = False  # run eval_fn after this window's average (elected rank only)
    max_overshoot: int = 0  # cpu_async: averages this rank may leave in flight


@dataclass(frozen=True)
class Plan:
    windows: tuple[Window, ...]


@dataclass(frozen=True)
class Report:
    """What a rank did in one window; sent before it averages, so planning overlaps the sync."""

    rank: int
    window: int
    epoch: int
    chunks: tuple[Chunk, ...]
    batches: int
    samples: int
    compute_ms: float
    loss_sum: float
    loss_count: int
    scalars: dict[str, tuple[float, float]] = field(default_factory=dict)
    prev_sync_ms: float | None = None  # the previous window's averaging wall time
    prev_divergence: float | None = None
    lr: float | None = None
    snapshot: Any = None  # flat parameters (controller-averaged modes)


@dataclass(frozen=True)
class Average:
    """Controller-averaged parameters sent back to a rank (cpu_* modes)."""

    window: int
    flat: Any


@dataclass(frozen=True)
class EvalResult:
    rank: int
    epoch: int
    value: float
    ms: float


@dataclass(frozen=True)
class Stop:
    reason: str
    send_state: bool = False


@dataclass(frozen=True)
class Final:
    rank: int
    params: dict[str, Any]
    buffers: dict[str, Any]


@dataclass(frozen=True)
class RankError:
    """A rank failed: its message (one line) and the traceback for the log."""

    rank: int
    message: str
    traceback: str
