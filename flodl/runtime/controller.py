"""The controller: plans every window, runs ElChe on what ranks report, aggregates the epochs.

It lives in the launcher and is a single-threaded state machine over one inbox of
``(rank, message)`` events: reader threads, the in-process link and the process supervisor all
post into it. Planning runs one window ahead (``lookahead``) so ranks never wait for a plan;
ElChe therefore sees each window's timings one window late, which it tolerates by design.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flodl.config import Mode, Outer, TrainerConfig
from flodl.elche import (
    ElChe,
    auto_max_overshoot,
    averaging_weights,
    buffer_weights,
    step_max_overshoot,
)
from flodl.metrics import EpochMetrics, SyncEvent
from flodl.runtime.dispatch import Coverage, EpochCursor, chunk_batches
from flodl.runtime.messages import (
    Average,
    EvalResult,
    Final,
    Plan,
    RankError,
    Ready,
    Report,
    Stop,
    Window,
)

log = logging.getLogger(__name__)

# A sync-mode plan bundles enough lock-step windows for about this much work, so the controller
# is not on every step's critical path.
_SYNC_PLAN_S = 0.25


class RunFailed(RuntimeError):
    """A rank failed; the message is the rank's own, reported once."""


@dataclass(frozen=True)
class Exited:
    """Posted by the supervisor when a rank process ends."""

    code: int
    tail: str = ""


@dataclass(frozen=True)
class Disconnected:
    reason: str


@dataclass
class Hooks:
    on_sync: Callable[[SyncEvent], None] = lambda ev: None
    on_epoch: Callable[[EpochMetrics], None] = lambda m: None
    on_progress: Callable[[int, int, int, float | None, list[float]], None] = (
        lambda epoch, done, total, loss, shares: None
    )


@dataclass
class _EpochTrack:
    epoch: int
    world: int
    planned: int = 0
    done: int = 0
    all_planned: bool = False
    eval_rank: int | None = None
    eval_value: float | None = None
    start: float = 0.0
    end: float = 0.0
    samples: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)
    batches: list[int] = field(default_factory=list)
    rank_samples: list[int] = field(default_factory=list)
    rank_loss: list[list[float]] = field(default_factory=list)
    compute_ms: list[float] = field(default_factory=list)
    lr: float | None = None

    def __post_init__(self) -> None:
        self.batches = [0] * self.world
        self.rank_samples = [0] * self.world
        self.rank_loss = [[0.0, 0.0] for _ in range(self.world)]
        self.compute_ms = [0.0] * self.world

    def add(self, report: Report) -> None:
        r = report.rank
        self.batches[r] += report.batches
        self.rank_samples[r] += report.samples
        self.samples += report.samples
        self.compute_ms[r] += report.compute_ms
        self.lr = report.lr if report.lr is not None else self.lr
        self.loss_sum += report.loss_sum
        self.loss_count += report.loss_count
        self.rank_loss[r][0] += report.loss_sum
        self.rank_loss[r][1] += report.loss_count
        for name, (total, count) in report.scalars.items():
            acc = self.scalars.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += count

    @property
    def closed(self) -> bool:
        waiting_eval = self.eval_rank is not None and self.eval_value is None
        return self.all_planned and self.done == self.planned and not waiting_eval


@dataclass
class _WindowTrack:
    index: int
    epoch: int
    batches: list[int]
    reports: dict[int, Report] = field(default_factory=dict)


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


class Controller:
    """Plans windows, feeds ElChe, averages for ``cpu_*`` modes, and aggregates metrics."""

    def __init__(
        self,
        config: TrainerConfig,
        world_size: int,
        speeds: list[float],
        has_eval: bool,
        hooks: Hooks | None = None,
        lookahead: int = 1,
    ) -> None:
        self.cfg = config
        self.world = world_size
        self.mode = config.elche.mode
        self.has_eval = has_eval
        self.hooks = hooks or Hooks()
        self.lookahead = lookahead
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.links: dict[int, Any] = {}
        self.ready: dict[int, Ready] = {}
        hint = speeds if len(set(speeds)) > 1 else None
        self.elche = ElChe(config.elche, world_size, speed_hint=hint) if world_size > 1 else None
        self.windows: dict[int, _WindowTrack] = {}
        self.epochs: dict[int, _EpochTrack] = {}
        self.closed_epochs: list[EpochMetrics] = []
        self.events: list[SyncEvent] = []
        self.next_window = 0
        self.completed = 0
        self.cursor: EpochCursor | None = None
        self.coverage: Coverage | None = None
        self.all_planned = False
        self.final: Final | None = None
        self.center: Any = None
        self.outer: Any = None
        self.overshoot = (0, 0, 0)  # cpu_async: (current, initial, cap) averages in flight
        self._failure: tuple[float, str] | None = None
        self._t_start = time.perf_counter()
        self._t_train = 0.0
        self._t_end = 0.0

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, rank: int, link: Any) -> None:
        self.links[rank] = link

    def post(self, rank: int, msg: Any) -> None:
        self.inbox.put((rank, msg))

    def _send(self, rank: int, msg: Any) -> None:
        self.links[rank].send(msg)

    # -- main loop -------------------------------------------------------------------------------
    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> ControllerResult:
        while not self._finished():
            if stop_requested():
                raise KeyboardInterrupt
            if self.final is None or self._failure is not None:
                self._check_deadlines()
            try:
                rank, msg = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            self._handle(rank, msg)
        return self._result()

    def _finished(self) -> bool:
        return self.final is not None and self.completed == self.next_window and not self._open()

    def _open(self) -> bool:
        return any(not t.closed for t in self.epochs.values())

    def _check_deadlines(self) -> None:
        now = time.perf_counter()
        if self._failure is not None and now >= self._failure[0]:
            raise RunFailed(self._failure[1])
        timeout = self.cfg.cluster.start_timeout_s
        if len(self.ready) < self.world and now - self._t_start > timeout:
            missing = sorted(set(range(self.world)) - set(self.ready))
            raise RunFailed(f"ranks {missing} did not get ready within {timeout:.0f} s")

    def _handle(self, rank: int, msg: Any) -> None:
        if isinstance(msg, Report):
            self._on_report(msg)
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, EvalResult):
            self.epochs[msg.epoch].eval_value = msg.value
            self._close_epochs()
        elif isinstance(msg, Final):
            self.final = msg
        elif isinstance(msg, RankError):
            raise RunFailed(f"rank {msg.rank} failed: {msg.message}")
        elif isinstance(msg, Exited):
            self._on_exit(rank, msg)
        elif isinstance(msg, Disconnected) and not self.all_planned:
            self._defer_failure(f"rank {rank} lost its control channel ({msg.reason})")

    def _on_exit(self, rank: int, msg: Exited) -> None:
        # After Stop, a clean exit is the normal end (rank 0 only once its state arrived).
        if msg.code == 0 and self.all_planned and (rank != 0 or self.final is not None):
            return
        if msg.code == 0 and rank == 0 and self.all_planned:
            self._defer_failure("rank 0 exited before sending its final state", grace_s=10.0)
            return
        detail = f": {msg.tail}" if msg.tail else ""
        self._defer_failure(f"rank {rank} exited with code {msg.code}{detail}")

    def _defer_failure(self, message: str, grace_s: float = 1.0) -> None:
        # Give the rank's own error message (already on its way) a moment to arrive first.
        if self._failure is None:
            self._failure = (time.perf_counter() + grace_s, message)

    # -- start -----------------------------------------------------------------------------------
    def _on_ready(self, msg: Ready) -> None:
        self.ready[msg.rank] = msg
        if len(self.ready) < self.world:
            return
        signatures = {r.signature for r in self.ready.values()}
        if len(signatures) > 1:
            detail = ", ".join(f"rank {r}: {m.signature}" for r, m in sorted(self.ready.items()))
            raise RunFailed(f"ranks built different model architectures ({detail})")
        sizes = {r.n_samples for r in self.ready.values()}
        if len(sizes) > 1:
            raise RunFailed(f"ranks loaded datasets of different sizes: {sorted(sizes)}")
        n_samples = sizes.pop()
        self._init_async(n_samples)
        self.coverage = Coverage(n_samples)
        self._t_train = time.perf_counter()
        self._new_epoch(0, n_samples)
        self._fill()

    def _init_async(self, n_samples: int) -> None:
        if self.mode is not Mode.CPU_ASYNC:
            return
        configured = self.cfg.elche.max_overshoot
        if configured is not None:
            self.overshoot = (configured, configured, configured)
        else:
            initial, cap = auto_max_overshoot(math.ceil(n_samples / self.cfg.batch_size))
            self.overshoot = (initial, initial, cap)
        self.lookahead = max(self.lookahead, self.overshoot[0] + 1)

    def _new_epoch(self, epoch: int, n_samples: int) -> None:
        self.cursor = EpochCursor(epoch, n_samples, self.cfg.batch_size)
        self.epochs[epoch] = _EpochTrack(epoch, self.world)

    # -- planning ----------------------------------------------------------------------------------
    def _fill(self) -> None:
        while not self.all_planned and self.next_window - self.completed <= self.lookahead:
            self._plan_batch()

    def _windows_per_plan(self) -> int:
        if not self.mode.is_sync or self.elche is None or not self.elche.calibrated:
            return 1
        slow = max((ms for ms in self.elche.smoothed_ms if ms), default=0.0)
        if slow <= 0:
            return 1
        return max(1, min(64, int(_SYNC_PLAN_S * 1000.0 / (slow * self.elche.anchor))))

    def _plan_batch(self) -> None:
        per_rank: list[list[Window]] = [[] for _ in range(self.world)]
        for _ in range(self._windows_per_plan()):
            assert self.cursor is not None
            if self.cursor.done and not self._advance_epoch():
                break
            for rank, window in enumerate(self._plan_window()):
                per_rank[rank].append(window)
            if self.cursor.done and self.cursor.epoch == self.cfg.num_epochs - 1:
                self.all_planned = True
                break
        for rank, windows in enumerate(per_rank):
            if windows:
                self._send(rank, Plan(tuple(windows)))
        if self.all_planned:
            for rank in range(self.world):
                self._send(rank, Stop("done", send_state=rank == 0))

    def _advance_epoch(self) -> bool:
        assert self.cursor is not None
        if self.cursor.epoch + 1 >= self.cfg.num_epochs:
            self.all_planned = True
            return False
        self._new_epoch(self.cursor.epoch + 1, self.cursor.n_samples)
        return True

    def _counts(self, remaining: int) -> list[int]:
        if self.elche is None:
            return [min(remaining, self.cfg.elche.anchor)]
        if self.mode.is_sync:  # lock-step: one batch each, then average (classic DDP)
            return [1 if r < remaining else 0 for r in range(self.world)]
        return self.elche.window(remaining)

    def _plan_window(self) -> list[Window]:
        assert self.cursor is not None
        cursor = self.cursor
        chunks = cursor.take(self._counts(cursor.remaining_batches))
        batches = [chunk_batches(c, self.cfg.batch_size) for c in chunks]
        if self.world > 1:
            weights = averaging_weights(batches, self.cfg.elche.gamma)
            bweights = buffer_weights(batches)
        else:
            weights, bweights = [1.0], [1.0]
        track = self.epochs[cursor.epoch]
        track.planned += 1
        eval_rank = None
        if cursor.done:
            track.all_planned = True
            eval_rank = self._eval_rank(cursor.epoch)
            track.eval_rank = eval_rank
        index = self.next_window
        self.next_window += 1
        self.windows[index] = _WindowTrack(index, cursor.epoch, batches)
        return [
            Window(
                index,
                cursor.epoch,
                chunks[r],
                weights[r],
                bweights[r],
                eval_after=eval_rank == r,
                max_overshoot=self.overshoot[0],
            )
            for r in range(self.world)
        ]

    def _eval_rank(self, epoch: int) -> int | None:
        last = epoch == self.cfg.num_epochs - 1
        if not self.has_eval or not (last or (epoch + 1) % self.cfg.eval_every == 0):
            return None
        policy = self.cfg.callback_policy
        if policy.kind == "rank":
            return policy.rank
        return self.elche.fastest_rank() if self.elche is not None else 0

    # -- reports -----------------------------------------------------------------------------------
    def _on_report(self, report: Report) -> None:
        track = self.windows[report.window]
        track.reports[report.rank] = report
        assert self.coverage is not None
        self.coverage.record(report.epoch, report.chunks)
        self.epochs[report.epoch].add(report)
        if len(track.reports) == self.world:
            self._complete(track)

    def _complete(self, track: _WindowTrack) -> None:
        reports = [track.reports[r] for r in range(self.world)]
        if self.mode.via_controller and self.world > 1:
            self._average(track, reports)
        self._record_cycle(track, reports)
        del self.windows[track.index]
        self.completed += 1
        epoch = self.epochs[track.epoch]
        epoch.done += 1
        self._progress(epoch)
        if epoch.all_planned and epoch.done == epoch.planned:
            epoch.end = time.perf_counter()
            self._t_end = epoch.end
        self._close_epochs()
        self._fill()

    def _record_cycle(self, track: _WindowTrack, reports: list[Report]) -> None:
        if self.elche is None:
            return
        syncs = [r.prev_sync_ms for r in reports if r.prev_sync_ms is not None]
        divs = [r.prev_divergence for r in reports if r.prev_divergence is not None]
        # The rank that arrived last waited least: its sync time is the collective's own cost.
        sync_ms = min(syncs) if syncs else 0.0
        cycle = self.elche.report(
            [r.compute_ms for r in reports],
            [r.batches for r in reports],
            sync_ms,
            divergence=max(divs) if divs else None,
            lr=reports[0].lr,
        )
        event = SyncEvent(
            index=track.index,
            epoch=track.epoch,
            wall_s=time.perf_counter() - self._t_train,
            anchor=cycle.anchor,
            counts=list(cycle.counts),
            batches=[r.batches for r in reports],
            compute_ms=[r.compute_ms for r in reports],
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

    def _average(self, track: _WindowTrack, reports: list[Report]) -> None:
        from flodl.runtime.averaging import weighted_mean  # torch only where averaging happens

        weights = averaging_weights(track.batches, self.cfg.elche.gamma)
        bweights = buffer_weights(track.batches)
        n_params = self.ready[0].n_params
        mean = weighted_mean([r.snapshot for r in reports], weights, bweights, n_params)
        alpha = self.cfg.elche.effective_easgd_alpha
        if alpha is not None and self.center is not None:
            self.center = (1 - alpha) * self.center + alpha * mean
        elif self.cfg.elche.outer is Outer.NESTEROV:
            if self.outer is None:
                from flodl.runtime.outer import make_outer

                self.outer = make_outer(self.cfg.elche, n_params)
            self.center = self.outer.step(mean)
        else:
            self.center = mean
        for rank in range(self.world):
            self._send(rank, Average(track.index, self.center))

    def _progress(self, epoch: _EpochTrack) -> None:
        total = self.cursor.n_samples if self.cursor is not None else 0
        loss = epoch.loss_sum / epoch.loss_count if epoch.loss_count else None
        share = self._shares(epoch.batches)
        self.hooks.on_progress(epoch.epoch, epoch.samples, total, loss, share)

    @staticmethod
    def _shares(batches: list[int]) -> list[float]:
        total = sum(batches)
        return [b / total if total else 0.0 for b in batches]

    # -- epochs ----------------------------------------------------------------------------------
    def _close_epochs(self) -> None:
        while True:
            epoch = len(self.closed_epochs)
            track = self.epochs.get(epoch)
            if track is None or not track.closed:
                return
            metrics = self._epoch_metrics(track)
            self.closed_epochs.append(metrics)
            self.hooks.on_epoch(metrics)

    def _epoch_metrics(self, t: _EpochTrack) -> EpochMetrics:
        previous = self.epochs.get(t.epoch - 1)
        t.start = previous.end if previous is not None else self._t_train
        epoch_s = max(t.end - t.start, 1e-9)
        per_rank = [
            {
                "loss": (ls / lc) if lc else math.nan,
                "batches": float(t.batches[r]),
                "samples": float(t.rank_samples[r]),
                "compute_ms": t.compute_ms[r],
            }
            for r, (ls, lc) in enumerate(t.rank_loss)
        ]
        last = self.events[-1] if self.events else None
        return EpochMetrics(
            epoch=t.epoch,
            avg_loss=t.loss_sum / t.loss_count if t.loss_count else math.nan,
            epoch_ms=epoch_s * 1000.0,
            scalars={k: s / c for k, (s, c) in t.scalars.items() if c},
            per_rank=per_rank,
            per_rank_throughput=[s / epoch_s for s in t.rank_samples],
            per_rank_batch_share=self._shares(t.batches),
            device_indices=list(range(self.world)),
            syncs=len(self.events) if self.world > 1 and self.mode is not Mode.SOLO else 0,
            anchor=last.anchor if last else self.cfg.elche.anchor,
            overhead=last.overhead if last else 0.0,
            eval_value=t.eval_value,
            lr=t.lr,
        )

    def _result(self) -> ControllerResult:
        tracks = list(self.epochs.values())
        rank_samples = [sum(t.rank_samples[r] for t in tracks) for r in range(self.world)]
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
            devices=[self.ready[r].device for r in range(self.world) if r in self.ready],
        )
