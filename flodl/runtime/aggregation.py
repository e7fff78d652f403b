"""Aggregation: what the controller makes of completed windows — ElChe cycles, controller-side
averages (``cpu_*`` modes), progress, epoch metrics and the run's result.

A mixin of :class:`flodl.runtime.controller.Controller` (see ``planning.py`` for the other half).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from flodl.config import Mode, Outer, TrainerConfig
from flodl.elche import ElChe, step_max_overshoot
from flodl.metrics import EpochMetrics, SyncEvent
from flodl.runtime.dispatch import Coverage, EpochCursor
from flodl.runtime.links import Outbound
from flodl.runtime.membership import Membership
from flodl.runtime.messages import Average, Final, Ready, Report
from flodl.runtime.snapshots import Checkpointer
from flodl.runtime.sums import SnapshotSums
from flodl.runtime.tracking import ControllerResult, EpochTrack, WindowTrack, shares

log = logging.getLogger(__name__)


class Aggregation(Outbound):
    """Turns completed windows into ElChe cycles, averages, metrics and the final result."""

    cfg: TrainerConfig
    world: int
    mode: Mode
    lookahead: int
    members: Membership
    elche: ElChe | None
    checkpointer: Checkpointer | None
    hooks: Any
    ready: dict[int, Ready]
    cursors: dict[int, EpochCursor]
    epochs: dict[int, EpochTrack]
    closed_epochs: list[EpochMetrics]
    events: list[SyncEvent]
    coverage: Coverage | None
    final: Final | None
    center: Any
    outer: Any
    sums: SnapshotSums | None  # cpu_* modes: the running sums of the snapshots
    overshoot: tuple[int, int, int]
    stop_reason: str | None
    _t_train: float
    _t_end: float
    eval_metric: str | None
    stopped_early: dict[str, Any] | None
    best: Any
    _after_epoch: Callable[[int, EpochMetrics, str | None], None]  # the controller's

    def _record_cycle(self, track: WindowTrack, reports: list[Report]) -> None:
        if self.elche is None:
            return
        compute, batches = [0.0] * self.world, [0] * self.world
        for r in reports:
            compute[r.rank], batches[r.rank] = r.compute_ms, r.batches
        syncs = [r.prev_sync_ms for r in reports if r.prev_sync_ms is not None]
        divs = [r.prev_divergence for r in reports if r.prev_divergence is not None]
        # The rank that arrived last waited least: its sync time is the collective's own cost.
        sync_ms = min(syncs) if syncs else 0.0
        divergence = max(divs) if divs else None
        if divergence is not None and not math.isfinite(divergence):
            divergence = None
        cycle = self.elche.report(
            compute, batches, sync_ms, divergence=divergence, lr=reports[0].lr
        )
        event = SyncEvent(
            index=track.index,
            epoch=track.epoch,
            wall_s=time.perf_counter() - self._t_train,
            anchor=cycle.anchor,
            counts=list(cycle.counts),
            batches=batches,
            compute_ms=compute,
            sync_ms=sync_ms,
            overhead=cycle.overhead,
            divergence=cycle.divergence,
            verdict=cycle.verdict.value,
            phase=cycle.phase.value,
        )
        self.events.append(event)
        self.hooks.on_sync(event)
        if self.mode is Mode.CPU_ASYNC and self.cfg.elche.max_overshoot is None:
            current, initial, cap = self.overshoot
            self.overshoot = (
                step_max_overshoot(current, cycle.verdict, initial, cap),
                initial,
                cap,
            )
            self.lookahead = max(self.lookahead, self.overshoot[0] + 1)

    def route(self, msg: Any, descriptors: list) -> dict:
        """For the launcher's readers: a cpu_* snapshot is summed as it arrives (no copy)."""
        return self.sums.route(msg, descriptors) if self.sums is not None else {}

    def _average(self, track: WindowTrack, reports: list[Report]) -> None:
        assert self.sums is not None
        for report in reports:
            if report.snapshot is not None:  # arrived whole (an in-process rank)
                self.sums.add_whole(report)
        mean = self.sums.take(track.index, [r.rank for r in reports])
        self.sums.drop(track.index)  # older sums: windows voided by a loss
        if mean is None:
            log.warning(
                "window %d: a snapshot was cut off by a rank loss, so its sum is incomplete; "
                "this round averages nothing (every rank keeps its weights; the next averages)",
                track.index,
            )
            self._send_each([r.rank for r in reports], Average(track.index, None))
            return
        alpha = self.cfg.elche.effective_easgd_alpha
        n_params = self.sums.n_params
        if alpha is not None and self.center is not None:
            self.center.mul_(1 - alpha).add_(mean, alpha=alpha)
        elif self.cfg.elche.outer is Outer.NESTEROV:
            if self.outer is None:
                from flodl.runtime.outer import make_outer

                self.outer = make_outer(self.cfg.elche, n_params)
            self.center = self.outer.step(mean)
        else:
            self.center = mean
        self._send_each([r.rank for r in reports], Average(track.index, self.center))
        if alpha is None:
            # A plain average is not state: holding it would overlap the next round's snapshots
            # (with outer=nesterov the state is the outer step's own, ``outer.previous``)
            self.center = None

    def _progress(self, epoch: EpochTrack) -> None:
        cursor = self.cursors.get(epoch.epoch)
        total = cursor.n_samples if cursor is not None else 0
        loss = epoch.loss_sum / epoch.loss_count if epoch.loss_count else None
        self.hooks.on_progress(epoch.epoch, epoch.samples, total, loss, shares(epoch.batches))

    def _close_epochs(self) -> None:
        while True:
            first = min(self.epochs) if self.epochs else 0
            epoch = first + len(self.closed_epochs)
            track = self.epochs.get(epoch)
            if track is None or not track.closed:
                return
            previous = self.epochs.get(epoch - 1)
            track.start = previous.end if previous is not None else self._t_train
            syncs = len(self.events) if self.world > 1 and self.mode is not Mode.SOLO else 0
            metrics = track.metrics(
                syncs,
                self.events[-1] if self.events else None,
                self.cfg.elche.anchor,
                self.eval_metric,
            )
            self.closed_epochs.append(metrics)
            self._after_epoch(track.epoch, metrics, self.hooks.on_epoch(metrics))

    def _result(self) -> ControllerResult:
        tracks = list(self.epochs.values())
        ranks = range(self.world)
        rank_samples = [sum(t.rank_samples[r] for t in tracks) for r in ranks]
        return ControllerResult(
            final=self.final,
            epochs=self.closed_epochs,
            events=self.events,
            coverage=self.coverage,
            train_s=max((self._t_end or time.perf_counter()) - self._t_train, 1e-9),
            samples=sum(rank_samples),
            rank_samples=rank_samples,
            rank_batches=[sum(t.batches[r] for t in tracks) for r in range(self.world)],
            rank_compute_ms=[sum(t.compute_ms[r] for t in tracks) for r in range(self.world)],
            rank_data_ms=[sum(t.data_ms[r] for t in tracks) for r in range(self.world)],
            rank_peak_mem=[max((t.peak_mem[r] for t in tracks), default=0) for r in ranks],
            stopped_early=self.stopped_early,
            best=self.best.to_dict() if self.best is not None else None,
            devices=[self.ready[r].device for r in range(self.world) if r in self.ready],
            stopped=self.stop_reason,
            saved=list(self.checkpointer.saved) if self.checkpointer is not None else [],
            lost_ranks=list(self.members.lost),
            save_error=getattr(self, "save_error", None),
        )
