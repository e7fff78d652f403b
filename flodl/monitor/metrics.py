"""What the launcher learns about a run: per averaging event, per epoch, per job.

Plain dataclasses so that callbacks, TensorBoard, the console and the A/B report all read the
same numbers. Per-rank lists are always in global rank order.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class SyncEvent:
    """One averaging event (one ElChe cycle): what every rank did since the previous one."""

    index: int
    epoch: int
    wall_s: float
    anchor: int
    counts: list[int]
    batches: list[int]
    compute_ms: list[float]
    sync_ms: float
    overhead: float
    divergence: float | None
    verdict: str
    phase: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EpochMetrics:
    """Handed to ``metrics_fn`` once per epoch, on the launcher, after all ranks aggregate.

    ``epoch`` counts from 1 — the n-th epoch, as the console's ``epoch n/N``, TensorBoard's
    step, ``eval_result_fn``, ``epoch_fn`` and ``summary.json`` all say. ``eval_metrics`` holds
    every eval metric of an evaluated epoch (``eval_loss`` and the task's metrics, each computed
    once over the whole eval set); ``eval_value`` is the one ``task.eval_metric`` names.
    ``per_rank`` carries telemetry per rank: ``busy_fraction``, ``data_wait_fraction`` and
    ``pace_overrun_fraction`` (CPU rig: paced steps past their deadlines) of the epoch's wall
    time and ``peak_mem_mb`` (CUDA max allocated; the process's peak RSS on CPU).
    """

    epoch: int
    avg_loss: float
    epoch_ms: float
    scalars: dict[str, float] = field(default_factory=dict)
    per_rank: list[dict[str, float]] = field(default_factory=list)
    per_rank_throughput: list[float] = field(default_factory=list)  # samples per second
    per_rank_batch_share: list[float] = field(default_factory=list)
    device_indices: list[int] = field(default_factory=list)
    syncs: int = 0
    anchor: int = 0
    overhead: float = 0.0
    eval_value: float | None = None
    lr: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunSummary:
    """``summary.json`` of one job."""

    status: str
    mode: str
    world_size: int
    epochs: int  # epochs finished, a resumed bundle's included (the console's and bundle's count)
    final_loss: float | None = None
    eval_metric: str | None = None
    eval_value: float | None = None
    wall_s: float = 0.0
    syncs: int = 0
    mean_sync_ms: float = 0.0
    samples_per_s: float = 0.0
    per_rank_batch_share: list[float] = field(default_factory=list)
    per_rank_sample_share: list[float] = field(default_factory=list)
    per_rank_throughput: list[float] = field(default_factory=list)
    idle_fraction: list[float] = field(default_factory=list)
    error: str | None = None
    overrides: list[str] = field(default_factory=list)
    loss_curve: list[tuple[float, float]] = field(default_factory=list)  # (wall_s, loss) per epoch
    samples_seen: int = 0
    anchor: int | None = None
    lost_ranks: list[int] = field(default_factory=list)
    coverage_exact: bool | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluated epoch's metrics
    best: dict[str, Any] | None = None  # save_best: monitor, mode, value, epoch, bundle stem
    stopped_early: dict[str, Any] | None = None  # early stop: reason and epoch
    telemetry: list[dict[str, Any]] = field(default_factory=list)  # per rank
    #: CPU rig: ``calibrated_step_ms`` (the step the ranks agreed on), ``pace_margin``,
    #: ``nominal_step_ms`` (their product: the speed-1.0 rank's paced step), ``speeds`` and the
    #: largest per-rank ``overrun_fraction``. Two rig jobs compare fairly only at equal nominal
    #: steps: the A/B report T-matches their throughput and warns when the steps differ.
    rig: dict[str, Any] | None = None
    #: Per rank, what it gave up to fit its device (``cluster.memory_plan``), as announced at
    #: start: ``rank 1 (6.0 GB): batch 32, activation checkpointing, ...``.
    memory_plans: list[str] = field(default_factory=list)
    #: The cpu_* modes' averaging traffic: ``compress`` (``elche.compress``), ``averages``
    #: sent, how many went ``uncompressed`` (and their ``uncompressed_windows``), ``up_bytes``
    #: (snapshots the controller received) and ``down_bytes`` (averages it sent, each rank
    #: counted). None in the collective modes and on one rank.
    averaging: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ScalarSink(threading.local):
    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}


_sink = _ScalarSink()


def record_scalar(name: str, value: float) -> None:
    """Record a named scalar inside ``train_step``; the epoch value is its batch-weighted mean."""
    _sink.values.setdefault(name, [0.0, 0.0])
    acc = _sink.values[name]
    acc[0] += float(value)
    acc[1] += 1.0


def drain_scalars() -> dict[str, tuple[float, float]]:
    """Return and clear this thread's recorded scalars as ``{name: (sum, count)}``."""
    out = {k: (v[0], v[1]) for k, v in _sink.values.items()}
    _sink.values.clear()
    return out
