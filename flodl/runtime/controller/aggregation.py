"""Aggregation: what the controller makes of completed windows — ElChe cycles (the sync-event
log), controller-side averages (``cpu_*`` modes), progress and the closed epochs' metrics.

A part of :class:`flodl.runtime.controller.controller.Controller`: the :class:`Aggregator` owns the
event
log, the closed epochs, the ``cpu_*`` snapshot sums and the outer momentum.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from flodl.config import ElCheConfig, Mode, Outer
from flodl.elche import ElChe
from flodl.elche.guard import Verdict
from flodl.monitor.metrics import EpochMetrics, SyncEvent
from flodl.runtime.controller.events import Hooks
from flodl.runtime.controller.sums import SnapshotSums
from flodl.runtime.controller.tracking import EpochTrack, WindowTrack, shares
from flodl.runtime.sync.codec import ConsensusCodec
from flodl.runtime.wire.messages import Average, Report
from flodl.runtime.wire.rank_link import Outbound

log = logging.getLogger(__name__)

AfterEpoch = Callable[[int, EpochMetrics, "str | None"], None]


class Aggregator:
    """Turns completed windows into ElChe cycles, averages and epoch metrics."""

    def __init__(
        self,
        elche_cfg: ElCheConfig,
        world: int,
        elche: ElChe | None,
        hooks: Hooks,
        out: Outbound,
        eval_metric: str | None = None,
        saved: dict[str, Any] | None = None,
    ) -> None:
        self.elche_cfg, self.world, self.elche = elche_cfg, world, elche
        self.mode = elche_cfg.mode
        self.hooks, self.out, self.eval_metric = hooks, out, eval_metric
        self.events: list[SyncEvent] = []
        self.closed_epochs: list[EpochMetrics] = []
        compressed = self.mode.via_controller and elche_cfg.compress != "none"
        # elche.compress: averages go down as changes against versions the ranks hold
        self.codec = ConsensusCodec(elche_cfg.compress) if compressed else None
        self.sums = SnapshotSums(elche_cfg.gamma, self.codec) if self.mode.via_controller else None
        self.down_bytes = 0  # averages' bytes sent, each rank counted (the summary's)
        self.averages = 0  # averages sent (a tainted window's None not counted)
        self.outer: Any = None
        self.t_train = 0.0  # when training started (see begin)
        self._restore(saved)

    def begin(self, now: float, n_params: int) -> None:
        """Training starts: event times and the first epoch's start count from ``now``;
        ``n_params``: the model's (the cpu_* sums' length)."""
        self.t_train = now
        if self.sums is not None:
            self.sums.n_params = n_params

    def _restore(self, saved: dict[str, Any] | None) -> None:
        """cpu_* modes: the outer momentum a resumed bundle holds (a bundle of a version that
        kept an EASGD centre holds that too: nothing reads it now)."""
        if not saved:
            return
        if saved.get("outer_previous") is not None:
            from flodl.runtime.sync.outer import make_outer

            self.outer = make_outer(self.elche_cfg, int(saved["outer_previous"].numel()))
            if self.outer is not None:
                self.outer.previous = saved["outer_previous"].clone()
                buffer = saved.get("outer_buffer")
                self.outer.buffer = buffer.clone() if buffer is not None else None

    def release(self) -> None:
        """Drop the outer state (at Stop, once it is saved)."""
        self.outer = None

    def state(self) -> dict[str, Any] | None:
        """cpu_* modes with outer=nesterov: what only the controller holds (the outer step's
        previous average and momentum)."""
        outer = self.outer
        if outer is None:
            return None
        return {"outer_previous": outer.previous, "outer_buffer": outer.buffer}

    def route(self, msg: Any, descriptors: list) -> dict:
        """For the launcher's readers: a cpu_* snapshot is summed as it arrives (no copy)."""
        return self.sums.route(msg, descriptors) if self.sums is not None else {}

    def complete(self, track: WindowTrack) -> Verdict | None:
        """A complete window: average it (cpu_* modes), log its cycle; ElChe's verdict."""
        if self.mode.via_controller and self.world > 1:
            self._average(track, [track.reports[r] for r in sorted(track.reports)])
        return self._record_cycle(track)

    def _record_cycle(self, track: WindowTrack) -> Verdict | None:
        if self.elche is None:
            return None
        # One pass over the reports in rank order (a window of 128 ranks brings 128).
        reports, compute, batches = track.reports, [0.0] * self.world, [0] * self.world
        syncs: list[float] = []
        divs: list[float] = []
        for rank in sorted(reports):
            r = reports[rank]
            compute[rank], batches[rank] = r.compute_ms, r.batches
            if r.prev_sync_ms is not None:
                syncs.append(r.prev_sync_ms)
            if r.prev_divergence is not None:
                divs.append(r.prev_divergence)
        # The rank that arrived last waited least: its sync time is the collective's own cost.
        sync_ms = min(syncs) if syncs else 0.0
        divergence = max(divs) if divs else None
        if divergence is not None and not math.isfinite(divergence):
            divergence = None
        cycle = self.elche.report(
            compute, batches, sync_ms, divergence=divergence, lr=reports[min(reports)].lr
        )
        event = SyncEvent(
            index=track.index,
            epoch=track.epoch,
            wall_s=time.perf_counter() - self.t_train,
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
        return cycle.verdict

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
            self.out.send_each([r.rank for r in reports], Average(track.index, None))
            return
        if self.elche_cfg.outer is Outer.NESTEROV:
            if self.outer is None:
                from flodl.runtime.sync.outer import make_outer

                self.outer = make_outer(self.elche_cfg, self.sums.n_params)
            mean = self.outer.step(mean)
        # The round's average goes out as it is: cpu_async's ranks blend it into their own
        # weights on arrival (EASGD, ``ControllerSync.take``). It is not kept (holding it
        # would overlap the next round's snapshots); with outer=nesterov the state is the
        # outer step's own, ``outer.previous``. Compressed, it goes as a change against the
        # version the ranks hold, and the codec keeps the consensus it defines.
        ranks = [r.rank for r in reports]
        payload = mean if self.codec is None else self.codec.down(track.index, mean, ranks)
        if self.outer is not None and self.codec is not None:  # the ranks' consensus, exactly
            self.outer.previous.copy_(mean[: self.sums.n_params])
        self.averages += 1
        self.down_bytes += int(getattr(payload, "nbytes", 0)) * len(ranks)
        self.out.send_each(ranks, Average(track.index, payload))

    def forget_references(self) -> None:
        """A new membership (a rank lost): the next average goes whole (see ConsensusCodec)."""
        if self.codec is not None:
            self.codec.forget()

    def wire_bytes(self) -> dict[str, Any] | None:
        """The cpu_* averages' bytes on the wire (the summary's ``averaging``): snapshots
        received, averages sent (each rank counted), and the rounds that went uncompressed."""
        if self.sums is None or self.world <= 1:
            return None
        whole = self.codec.whole_windows if self.codec is not None else None
        return {
            "compress": self.elche_cfg.compress,
            "averages": self.averages,
            "uncompressed": len(whole) if whole is not None else self.averages,
            "uncompressed_windows": list(whole) if whole is not None else [],
            "up_bytes": self.sums.up_bytes,
            "down_bytes": self.down_bytes,
        }

    def progress(self, epoch: EpochTrack, total: int) -> None:
        loss = epoch.loss_sum / epoch.loss_count if epoch.loss_count else None
        self.hooks.on_progress(epoch.epoch, epoch.samples, total, loss, shares(epoch.batches))

    def close_epochs(self, epochs: dict[int, EpochTrack], after: AfterEpoch) -> None:
        """Close, in order, every epoch whose work, eval and averaging are all in; ``after``
        gets each closed epoch's metrics and the stop request its ``on_epoch`` hook made."""
        while True:
            first = min(epochs) if epochs else 0
            epoch = first + len(self.closed_epochs)
            track = epochs.get(epoch)
            if track is None or not track.closed:
                return
            previous = epochs.get(epoch - 1)
            track.start = previous.end if previous is not None else self.t_train
            syncs = len(self.events) if self.world > 1 and self.mode is not Mode.SOLO else 0
            metrics = track.metrics(
                syncs,
                self.events[-1] if self.events else None,
                self.elche_cfg.anchor,
                self.eval_metric,
            )
            self.closed_epochs.append(metrics)
            after(track.epoch, metrics, self.hooks.on_epoch(metrics))
