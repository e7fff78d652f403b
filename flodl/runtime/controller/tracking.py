"""The controller's bookkeeping: what each window and each epoch has seen, and the result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flodl.monitor.metrics import EpochMetrics, SyncEvent
from flodl.runtime.controller.dispatch import Coverage
from flodl.runtime.wire.messages import Chunk, Final, Report


@dataclass
class WindowTrack:
    """One planned window: what each rank was given and what it reported."""

    index: int
    epoch: int
    batches: list[int]
    chunks: list[tuple[Chunk, ...]]
    expected: set[int]
    reports: dict[int, Report] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        # Asked on every report: the count settles it until the last one (reports only ever
        # come from expected ranks, see Controller._on_report).
        if len(self.reports) < len(self.expected):
            return False
        return self.expected <= self.reports.keys()


@dataclass
class EpochTrack:
    """Running totals of one epoch, closed into :class:`EpochMetrics` once it is all done."""

    epoch: int
    world: int
    planned: int = 0
    done: int = 0
    all_planned: bool = False
    eval_window: int | None = None  # the window the eval ranks evaluate after
    eval_waiting: set[int] = field(default_factory=set)  # ranks whose shard has not arrived
    eval_parts: dict[int, Any] = field(default_factory=dict)  # shard index -> metric states
    eval_skipped: bool = False  # a shard's rank was lost: no metrics this epoch
    eval_metrics: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0
    samples: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    lr: float | None = None
    scalars: dict[str, list[float]] = field(default_factory=dict)
    batches: list[int] = field(default_factory=list)
    rank_samples: list[int] = field(default_factory=list)
    rank_loss: list[list[float]] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    # Ranks whose averaging of this epoch's last window is not yet known to have held
    # (collective modes): until then its work is not known to be in the model.
    unsettled: set[int] = field(default_factory=set)
    data_ms: list[float] = field(default_factory=list)
    overrun_ms: list[float] = field(default_factory=list)
    peak_mem: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.batches = [0] * self.world
        self.rank_samples = [0] * self.world
        self.rank_loss = [[0.0, 0.0] for _ in range(self.world)]
        self.compute_ms = [0.0] * self.world
        self.data_ms = [0.0] * self.world
        self.overrun_ms = [0.0] * self.world
        self.peak_mem = [0] * self.world

    def plan_eval(self, window: int, ranks: set[int]) -> None:
        """The epoch's last window was (re)planned: expect a shard from each of ``ranks``."""
        self.eval_window = window if ranks else None
        self.eval_waiting = set(ranks)
        self.eval_parts = {}
        self.eval_skipped = False

    def take_eval(self, rank: int, window: int, shard: int, parts: Any) -> bool:
        """Keep a shard; True once every expected shard is in (stale results are ignored),
        the shards then merged into :attr:`eval_metrics` (unless the eval was skipped)."""
        if window != self.eval_window or rank not in self.eval_waiting:
            return False
        self.eval_waiting.discard(rank)
        self.eval_parts[shard] = parts
        if self.eval_waiting:
            return False
        if not self.eval_skipped:
            from flodl.step.evaluation import merge  # torch only where metrics are computed

            self.eval_metrics = merge([self.eval_parts[s] for s in sorted(self.eval_parts)])
        self.eval_parts = {}
        return True

    def lose_eval(self, rank: int) -> bool:
        """``rank`` is lost with its shard pending: skip this epoch's eval. True if it was."""
        if rank not in self.eval_waiting:
            return False
        self.eval_waiting.discard(rank)
        self.eval_skipped = True
        self.eval_parts = {}
        return True

    def add(self, report: Report) -> None:
        """One report into the totals: O(1) (the controller calls it on every report)."""
        r, samples, loss_sum, loss_count = (
            report.rank,
            report.samples,
            report.loss_sum,
            report.loss_count,
        )
        self.batches[r] += report.batches
        self.rank_samples[r] += samples
        self.samples += samples
        self.compute_ms[r] += report.compute_ms
        self.data_ms[r] += report.data_ms
        if report.overrun_ms:
            self.overrun_ms[r] += report.overrun_ms
        if report.peak_mem > self.peak_mem[r]:
            self.peak_mem[r] = report.peak_mem
        if report.lr is not None:
            self.lr = report.lr
        self.loss_sum += loss_sum
        self.loss_count += loss_count
        rank_loss = self.rank_loss[r]
        rank_loss[0] += loss_sum
        rank_loss[1] += loss_count
        if not report.scalars:
            return
        for name, (total, count) in report.scalars.items():
            acc = self.scalars.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += count

    def remove(self, report: Report) -> None:
        """Take back a lost rank's report (its work is trained again by others)."""
        r = report.rank
        self.batches[r] -= report.batches
        self.rank_samples[r] -= report.samples
        self.samples -= report.samples
        self.compute_ms[r] -= report.compute_ms
        self.data_ms[r] -= report.data_ms
        self.overrun_ms[r] -= report.overrun_ms
        self.loss_sum -= report.loss_sum
        self.loss_count -= report.loss_count
        self.rank_loss[r][0] -= report.loss_sum
        self.rank_loss[r][1] -= report.loss_count
        for name, (total, count) in report.scalars.items():  # its record_scalar values too
            acc = self.scalars.get(name)
            if acc is not None:
                acc[0] -= total
                acc[1] -= count

    @property
    def closed(self) -> bool:
        done = self.all_planned and self.done == self.planned
        return done and not self.eval_waiting and not self.unsettled

    def metrics(
        self, syncs: int, last: SyncEvent | None, anchor: int, eval_metric: str | None = None
    ) -> EpochMetrics:
        """The closed epoch; ``epoch`` counts from 1 (the n-th epoch), as the console shows."""
        epoch_s = max(self.end - self.start, 1e-9)
        per_rank = [
            {
                "loss": (ls / lc) if lc else math.nan,
                "batches": float(self.batches[r]),
                "samples": float(self.rank_samples[r]),
                "compute_ms": self.compute_ms[r],
                "busy_fraction": max(0.0, self.compute_ms[r] - self.data_ms[r]) / 1e3 / epoch_s,
                "data_wait_fraction": self.data_ms[r] / 1e3 / epoch_s,
                "pace_overrun_fraction": self.overrun_ms[r] / 1e3 / epoch_s,
                "peak_mem_mb": self.peak_mem[r] / 2**20,
            }
            for r, (ls, lc) in enumerate(self.rank_loss)
        ]
        from flodl.step.evaluation import primary_name

        evals = self.eval_metrics
        name = primary_name(evals, eval_metric)
        primary = evals[name] if name is not None else None
        return EpochMetrics(
            epoch=self.epoch + 1,
            avg_loss=self.loss_sum / self.loss_count if self.loss_count else math.nan,
            epoch_ms=epoch_s * 1000.0,
            scalars={k: s / c for k, (s, c) in self.scalars.items() if c},
            per_rank=per_rank,
            per_rank_throughput=[s / epoch_s for s in self.rank_samples],
            per_rank_batch_share=shares(self.batches),
            device_indices=list(range(self.world)),
            syncs=syncs,
            anchor=last.anchor if last else anchor,
            overhead=last.overhead if last else 0.0,
            eval_value=primary,
            eval_metrics=dict(evals),
            lr=self.lr,
        )


def shares(batches: list[int]) -> list[float]:
    total = sum(batches)
    return [b / total if total else 0.0 for b in batches]


@dataclass
class ControllerResult:
    final: Final | None
    epochs: list[EpochMetrics]
    events: list[SyncEvent]
    coverage: Coverage | None
    train_s: float
    samples: int
    rank_samples: list[int]
    rank_batches: list[int]
    rank_compute_ms: list[float]
    devices: list[str]
    rank_data_ms: list[float] = field(default_factory=list)
    rank_overrun_ms: list[float] = field(default_factory=list)
    rank_peak_mem: list[int] = field(default_factory=list)
    stopped_early: dict[str, Any] | None = None  # a normal stop: early stopping, metrics_fn
    best: dict[str, Any] | None = None  # save_best's best value and its epoch
    stopped: str | None = None
    saved: list[str] = field(default_factory=list)
    lost_ranks: list[int] = field(default_factory=list)
    save_error: str | None = None  # a checkpoint that could not be written (the run stopped)
    extra: dict[str, Any] = field(default_factory=dict)
    calibrated_step_ms: float = 0.0  # CPU rig: the agreed step before the pace margin
    memory_plans: list[str] = field(default_factory=list)  # per rank, as announced
    averaging: dict[str, Any] | None = None  # cpu_* modes: averages' bytes on the wire
