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
    batch_size: int = 0  # this rank's batch size (configured or probed); 0: trainer.batch_size


@dataclass(frozen=True)
class Window:
    """One averaging window for one rank: the chunks it trains, then its averaging weights."""

    index: int
    epoch: int
    chunks: tuple[Chunk, ...]
    weight: float  # this rank's share of the parameter average
    buffer_weight: float  # this rank's share of the float-buffer average
    eval_after: bool = False  # evaluate after this window's average (the eval ranks only)
    eval_shard: tuple[int, int] = (0, 1)  # (shard, shards) of the eval set this rank evaluates
    max_overshoot: int = 0  # cpu_async: averages this rank may leave in flight
    checkpoint_after: bool = False  # send RankState after this window's average
    checkpoint_weights: bool = False  # ... with the consensus weights (one rank: the head)
    generation: int = 0  # membership generation it was planned for
    settle: bool = False  # the epoch's last window: acknowledge its averaging (Settled)
    progress: int = 0  # global progress clock: samples of the run dispatched before this window
    window_samples: int = 0  # samples of this window over all ranks


@dataclass(frozen=True)
class Settled:
    """A rank's collective averaging of an epoch's last window held: the epoch may close."""

    rank: int
    window: int


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
    data_ms: float = 0.0  # of compute_ms, the time spent waiting for batches
    peak_mem: int = 0  # bytes: CUDA max_memory_allocated, or the process's peak RSS on CPU
    steps: tuple[tuple[int, float, float], ...] = ()  # (rank step, loss, lr), every n-th step


@dataclass(frozen=True)
class Average:
    """Controller-averaged parameters sent back to a rank (cpu_* modes)."""

    window: int
    flat: Any


@dataclass(frozen=True)
class EvalResult:
    """One rank's eval shard: torchmetrics states (on CPU) the controller merges, then computes."""

    rank: int
    epoch: int
    window: int  # the window it evaluated after (a replanned window's stale result is ignored)
    parts: dict[str, Any]
    ms: float
    shard: int = 0


@dataclass(frozen=True)
class Stop:
    reason: str
    send_state: bool = False  # send Final (rank 0 for the trained state)
    checkpoint: bool = False  # every rank sends RankState first (graceful save)


@dataclass(frozen=True)
class RankState:
    """A rank's resumable state after an average: its optimizer, scheduler and RNG (and, from
    the rank that is asked, the consensus parameters and buffers)."""

    rank: int
    window: int
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: Any
    params: dict[str, Any] | None = None
    buffers: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None  # 16-mixed: the GradScaler's state


@dataclass(frozen=True)
class Restore:
    """Sent before the first plan of a resumed run."""

    params: dict[str, Any]
    buffers: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: Any
    epoch: int
    scaler: dict[str, Any] | None = None


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


@dataclass(frozen=True)
class Abort:
    """The launcher ends the run (another rank failed): exit quietly, this is no lost launcher."""

    reason: str


@dataclass(frozen=True)
class Heartbeat:
    rank: int


@dataclass(frozen=True)
class Regroup:
    """Ranks were lost: rebuild the process group over ``members`` and re-average.

    Windows planned after ``last_window`` for an older generation are void: drop them.
    """

    generation: int
    members: tuple[int, ...]
    last_window: int
    weights: dict[int, float]  # each member's share of the re-average


@dataclass(frozen=True)
class Regrouped:
    rank: int
    generation: int
    unaveraged: int = -1  # the window whose collective averaging failed on this rank, if any
