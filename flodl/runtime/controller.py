"""The controller: plans every window, runs ElChe on what ranks report, aggregates the epochs.

It lives in the launcher and is a single-threaded state machine over one inbox of
``(rank, message)`` events: reader threads, the in-process link and the process supervisor all
post into it. Planning runs one window ahead (``lookahead``) so ranks never wait for a plan;
ElChe therefore sees each window's timings one window late, which it tolerates by design.

Ranks keep their launch index for life; after a loss the survivors form a new process group
(a new *generation*) and the dead rank's unfinished work goes back to its epoch's cursor.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flodl.config import Mode, Outer, TrainerConfig
from flodl.elche import (
    ElChe,
    ElCheState,
    auto_max_overshoot,
    averaging_weights,
    buffer_weights,
    step_max_overshoot,
)
from flodl.metrics import EpochMetrics, SyncEvent
from flodl.runtime.dispatch import Coverage, EpochCursor, chunk_batches
from flodl.runtime.membership import Membership, failure_budget
from flodl.runtime.messages import (
    Average,
    EvalResult,
    Final,
    Heartbeat,
    Plan,
    RankError,
    RankState,
    Ready,
    Regroup,
    Regrouped,
    Report,
    Stop,
    Window,
)
from flodl.runtime.snapshots import Checkpointer, ResumePoint
from flodl.runtime.tracking import ControllerResult, EpochTrack, WindowTrack, shares

log = logging.getLogger(__name__)

# A sync-mode plan bundles enough lock-step windows for about this much work, so the controller
# is not on every step's critical path.
_SYNC_PLAN_S = 0.25

__all__ = ["Controller", "ControllerResult", "Disconnected", "Exited", "Hooks", "RunFailed"]


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
    kill_rank: Callable[[int], None] = lambda rank: None


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
        checkpointer: Checkpointer | None = None,
        resume: ResumePoint | None = None,
    ) -> None:
        self.cfg = config
        self.world = world_size
        self.mode = config.elche.mode
        self.has_eval = has_eval
        self.hooks = hooks or Hooks()
        self.lookahead = lookahead
        self.checkpointer = checkpointer
        self.resume = resume
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.links: dict[int, Any] = {}
        self.ready: dict[int, Ready] = {}
        self.members = Membership(
            world_size,
            failure_budget(config.max_failure, world_size),
            config.cluster.heartbeat_timeout_s,
        )
        self.elche = self._make_elche(speeds)
        self.windows: dict[int, WindowTrack] = {}
        self.epochs: dict[int, EpochTrack] = {}
        self.cursors: dict[int, EpochCursor] = {}
        self.closed_epochs: list[EpochMetrics] = []
        self.events: list[SyncEvent] = []
        self.next_window = 0
        self.completed = 0
        self.coverage: Coverage | None = None
        self.all_planned = False
        self.final: Final | None = None
        self.center: Any = None
        self.outer: Any = None
        self.overshoot = (0, 0, 0)  # cpu_async: (current, initial, cap) averages in flight
        self.global_step = resume.meta.global_step if resume is not None else 0
        self.rounds_before = resume.meta.sync_round if resume is not None else 0
        self.stop_reason: str | None = None
        self.regrouping: dict[int, bool] = {}
        self._stop_sent = False
        self._stop_deadline = 0.0
        self._checkpoints_open = 0
        self._checkpoint_epochs: dict[int, int] = {}
        self._failure: tuple[float, str] | None = None
        self._t_start = time.perf_counter()
        self._t_train = 0.0
        self._t_end = 0.0

    def _make_elche(self, speeds: list[float]) -> ElChe | None:
        if self.world < 2:
            return None
        hint = speeds if len(set(speeds)) > 1 else None
        saved = self.resume.meta.elche_state if self.resume is not None else None
        state = ElCheState.from_dict(saved) if saved else None
        return ElChe(self.cfg.elche, self.world, speed_hint=hint, state=state)

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, rank: int, link: Any) -> None:
        self.links[rank] = link

    def post(self, rank: int, msg: Any) -> None:
        self.inbox.put((rank, msg))

    def _send(self, rank: int, msg: Any) -> None:
        try:
            self.links[rank].send(msg)
        except OSError as exc:  # the rank is going away; its exit is handled as a loss
            log.debug("send to rank %d failed: %s", rank, exc)

    @property
    def alive(self) -> list[int]:
        return self.members.members

    # -- main loop -------------------------------------------------------------------------------
    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> ControllerResult:
        while not self._finished():
            if stop_requested() and self.stop_reason is None:
                self.begin_stop("interrupted")
            if self.stop_reason is not None and time.perf_counter() > self._stop_deadline:
                raise KeyboardInterrupt  # ranks did not wind down in time: tear them down
            self._check_deadlines()
            try:
                rank, msg = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            self.members.seen(rank)
            self._handle(rank, msg)
        return self._result()

    def _finished(self) -> bool:
        if self.final is None or self.windows or self._checkpoints_open or self.regrouping:
            return False
        return self.stop_reason is not None or not self._open()

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
        if len(self.ready) == self.world and not self._stop_sent:
            for rank in self.members.stale():
                log.warning(
                    "rank %d: no heartbeat for %.0f s; dropping it",
                    rank,
                    self.members.heartbeat_timeout_s,
                )
                self.hooks.kill_rank(rank)
                self._lose(rank, "heartbeat went stale")

    def _handle(self, rank: int, msg: Any) -> None:
        if isinstance(msg, Report):
            self._on_report(msg)
        elif isinstance(msg, Heartbeat):
            return
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, EvalResult):
            self.epochs[msg.epoch].eval_value = msg.value
            self._close_epochs()
        elif isinstance(msg, Final):
            self.final = msg
        elif isinstance(msg, RankState):
            self._on_rank_state(msg)
        elif isinstance(msg, Regrouped):
            self._on_regrouped(msg)
        elif isinstance(msg, RankError):
            self._on_failure(msg.rank, f"rank {msg.rank} failed: {msg.message}", immediate=True)
        elif isinstance(msg, Exited):
            self._on_exit(rank, msg)
        elif isinstance(msg, Disconnected) and not self._stop_sent:
            self._on_failure(rank, f"rank {rank} lost its control channel ({msg.reason})")

    # -- failures and membership -------------------------------------------------------------------
    def _on_exit(self, rank: int, msg: Exited) -> None:
        # After Stop, a clean exit is the normal end (rank 0 only once its state arrived).
        if msg.code == 0 and self._stop_sent and (self.final is not None or rank != self._head()):
            return
        detail = f": {msg.tail}" if msg.tail else ""
        self._on_failure(rank, f"rank {rank} exited with code {msg.code}{detail}")

    def _on_failure(self, rank: int, message: str, immediate: bool = False) -> None:
        if not self._formed() or self._stop_sent:
            # Before the cohort forms (or while it winds down) a failure fails the job fast.
            if immediate:
                raise RunFailed(message)
            self._defer_failure(message)
            return
        self._lose(rank, message)

    def _formed(self) -> bool:
        return len(self.ready) == self.world and self.coverage is not None

    def _defer_failure(self, message: str, grace_s: float = 1.0) -> None:
        # Give the rank's own error message (already on its way) a moment to arrive first.
        if self._failure is None:
            self._failure = (time.perf_counter() + grace_s, message)

    def _lose(self, rank: int, why: str) -> None:
        if not self.members.lose(rank):
            return
        log.warning("lost rank %d (%s); %d rank(s) go on", rank, why, len(self.alive))
        if not self.alive:
            raise RunFailed(f"every rank was lost; last: {why}")
        first_open = self.completed_index()
        members = tuple(self.alive)
        self.regrouping = {r: False for r in members}  # no planning until survivors regroup
        self._void_windows(rank, first_open)
        weights = {r: 1.0 / len(members) for r in members}
        for r in members:
            self._send(r, Regroup(self.members.generation, members, first_open, weights))

    def completed_index(self) -> int:
        """Index of the oldest window not completed yet (every later one is open too)."""
        return min(self.windows, default=self.next_window)

    def _void_windows(self, dead: int, first_open: int) -> None:
        """The dead rank's work in open windows is lost. Later windows are void: what survivors
        already reported there (cpu_async runs ahead) stays trained, the rest is given back."""
        assert self.coverage is not None
        for index in sorted(self.windows):
            track = self.windows[index]
            for r in sorted(track.expected):
                if r == dead or (index != first_open and r not in track.reports):
                    self._give_back(track, r)
            if index == first_open:
                track.expected.discard(dead)
                track.batches[dead] = 0
            else:
                del self.windows[index]
                self.epochs[track.epoch].planned -= 1
                self.completed += 1
        if first_open in self.windows and self.windows[first_open].complete:
            self._complete(self.windows[first_open])

    def _give_back(self, track: WindowTrack, rank: int) -> None:
        chunks = track.chunks[rank]
        if not chunks:
            return
        report = track.reports.pop(rank, None)
        if report is not None:
            assert self.coverage is not None
            self.coverage.unrecord(track.epoch, chunks)
            self.epochs[track.epoch].remove(report)
        self.cursors[track.epoch].give_back(list(chunks))
        self.epochs[track.epoch].all_planned = False
        self.all_planned = False

    def _on_regrouped(self, msg: Regrouped) -> None:
        if msg.generation != self.members.generation or msg.rank not in self.regrouping:
            return
        self.regrouping[msg.rank] = True
        if not all(self.regrouping.values()):
            return
        self.regrouping = {}
        if self.members.over_budget:
            self.begin_stop("max_failure")
            return
        if len(self.alive) == 1:
            log.warning("rank %d goes on alone", self.alive[0])
        self._fill()
        self._maybe_send_stop()

    def _head(self) -> int:
        """The rank that sends the final state: the first survivor."""
        return self.alive[0] if self.alive else 0

    # -- stopping --------------------------------------------------------------------------------
    def begin_stop(self, reason: str, grace_s: float = 8.0) -> None:
        """Stop dispatching; once in-flight windows are averaged, save (if set up) and end."""
        log.warning("stopping (%s): finishing in-flight windows", reason)
        self.stop_reason = reason
        self._stop_deadline = time.perf_counter() + grace_s
        if not self._formed():
            raise KeyboardInterrupt  # nothing trained yet: nothing to save
        self._maybe_send_stop()

    def _maybe_send_stop(self) -> None:
        if self._stop_sent or self.windows or self.regrouping:
            return
        if self.stop_reason is None and not self.all_planned:
            return
        self._stop_sent = True
        save = self.checkpointer is not None and self.checkpointer.enabled
        if save:
            self._checkpoints_open += 1
        head = self._head()
        for rank in self.alive:
            stop = Stop(self.stop_reason or "done", send_state=rank == head, checkpoint=save)
            self._send(rank, stop)

    # -- checkpoints -----------------------------------------------------------------------------
    def _on_rank_state(self, msg: RankState) -> None:
        assert self.checkpointer is not None
        states = self.checkpointer.collect(msg, len(self.alive))
        if states is None:
            return
        if msg.window >= 0:  # an epoch-boundary checkpoint: the epoch is complete
            epoch = self._checkpoint_epochs.pop(msg.window)
            self._write(states, "checkpoint", epoch + 1, [])
        else:  # the end of the run, or a stop: the lowest unfinished epoch is the resume point
            epoch, uncovered = self._resume_point()
            self._write(states, self.stop_reason or "final", epoch, uncovered)
        self._checkpoints_open -= 1

    def _resume_point(self) -> tuple[int, list]:
        for epoch in sorted(self.cursors):
            if not self.cursors[epoch].done:
                return epoch, list(self.cursors[epoch].ranges)
        return max(self.cursors, default=-1) + 1, []

    def _write(self, states: dict, reason: str, epoch: int, uncovered: list) -> None:
        assert self.checkpointer is not None and self.coverage is not None
        self.checkpointer.write(
            states,
            reason,
            epoch=epoch,
            global_step=self.global_step,
            sync_round=self.rounds_before + self.completed,
            elche_state=self.elche.state().to_dict() if self.elche is not None else None,
            coverage={"epoch": epoch, "n_samples": self.coverage.n_samples, "uncovered": uncovered},
            extra={"lost_ranks": list(self.members.lost)},
        )

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
        if self.checkpointer is not None:
            self.checkpointer.signature = signatures.pop()
        start, ranges = self._resume_ranks(n_samples)
        if start >= self.cfg.num_epochs:
            raise RunFailed(
                f"checkpoint already finished {start} epochs; trainer.num_epochs="
                f"{self.cfg.num_epochs} leaves nothing to train"
            )
        self._init_async(n_samples)
        self.coverage = Coverage(n_samples)
        self._t_train = time.perf_counter()
        self._new_epoch(start, n_samples, ranges)
        self._fill()

    def _resume_ranks(self, n_samples: int) -> tuple[int, list]:
        """Hand every rank its saved state; return the epoch and ranges to start from."""
        if self.resume is None:
            return 0, []
        meta = self.resume.meta
        signature = next(iter(self.ready.values())).signature
        if meta.signature and meta.signature != signature:
            raise RunFailed(
                f"checkpoint {self.resume.stem} was saved for another model (architecture "
                f"{meta.signature} != {signature}); point trainer.resume_from at this model's"
            )
        saved_n = (meta.coverage or {}).get("n_samples", n_samples)
        if saved_n != n_samples:
            raise RunFailed(
                f"checkpoint saw {saved_n} samples per epoch, the dataset has {n_samples}"
            )
        for rank in range(self.world):
            self._send(rank, self.resume.restore_for(rank))
        return meta.epoch, self.resume.uncovered()

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

    def _new_epoch(self, epoch: int, n_samples: int, ranges: list | None = None) -> None:
        self.cursors[epoch] = EpochCursor(epoch, n_samples, self.cfg.batch_size, list(ranges or []))
        self.epochs[epoch] = EpochTrack(epoch, self.world)

    # -- planning --------------------------------------------------------------------------------
    def _fill(self) -> None:
        while (
            self.stop_reason is None
            and not self.regrouping
            and not self.all_planned
            and self.next_window - self.completed <= self.lookahead
        ):
            self._plan_batch()

    def _windows_per_plan(self) -> int:
        if not self.mode.is_sync or self.elche is None or not self.elche.calibrated:
            return 1
        slow = max((ms for ms in self.elche.smoothed_ms if ms), default=0.0)
        if slow <= 0:
            return 1
        return max(1, min(64, int(_SYNC_PLAN_S * 1000.0 / (slow * self.elche.anchor))))

    def _cursor(self) -> EpochCursor | None:
        """The lowest epoch with work left, opening the next epoch when all are done."""
        for epoch in sorted(self.cursors):
            if not self.cursors[epoch].done:
                return self.cursors[epoch]
        last = max(self.cursors)
        if last + 1 >= self.cfg.num_epochs:
            self.all_planned = True
            return None
        self._new_epoch(last + 1, self.cursors[last].n_samples)
        return self.cursors[last + 1]

    def _plan_batch(self) -> None:
        per_rank: dict[int, list[Window]] = {r: [] for r in self.alive}
        for _ in range(self._windows_per_plan()):
            cursor = self._cursor()
            if cursor is None:
                break
            for rank, window in self._plan_window(cursor).items():
                per_rank[rank].append(window)
        for rank, windows in per_rank.items():
            if windows:
                self._send(rank, Plan(tuple(windows)))
        if not self.all_planned and self._cursor() is None:
            self.all_planned = True

    def _counts(self, remaining: int) -> list[int]:
        alive = self.members.alive
        if self.elche is None:
            return [min(remaining, self.cfg.elche.anchor)]
        if self.mode.is_sync:  # lock-step: one batch each, then average (classic DDP)
            counts, left = [], remaining
            for ok in alive:
                counts.append(1 if ok and left > 0 else 0)
                left -= counts[-1]
            return counts
        return self.elche.window(remaining, alive=alive)

    def _plan_window(self, cursor: EpochCursor) -> dict[int, Window]:
        chunks = cursor.take(self._counts(cursor.remaining_batches))
        batches = [chunk_batches(c, self.cfg.batch_size) for c in chunks]
        if self.world > 1:
            weights = averaging_weights(batches, self.cfg.elche.gamma)
            bweights = buffer_weights(batches)
        else:
            weights, bweights = [1.0], [1.0]
        track = self.epochs[cursor.epoch]
        track.planned += 1
        index = self.next_window
        self.next_window += 1
        eval_rank, checkpoint = None, False
        if cursor.done:
            track.all_planned = True
            eval_rank = track.eval_rank = self._eval_rank(cursor.epoch)
            if self.checkpointer is not None:
                checkpoint = self.checkpointer.due(cursor.epoch, self.cfg.num_epochs)
            if checkpoint:
                self._checkpoint_epochs[index] = cursor.epoch
                self._checkpoints_open += 1
        self.windows[index] = WindowTrack(
            index, cursor.epoch, batches, list(chunks), set(self.alive)
        )
        return {
            r: Window(
                index,
                cursor.epoch,
                chunks[r],
                weights[r],
                bweights[r],
                eval_after=eval_rank == r,
                max_overshoot=self.overshoot[0],
                checkpoint_after=checkpoint,
                generation=self.members.generation,
            )
            for r in self.alive
        }

    def _eval_rank(self, epoch: int) -> int | None:
        last = epoch == self.cfg.num_epochs - 1
        if not self.has_eval or not (last or (epoch + 1) % self.cfg.eval_every == 0):
            return None
        policy = self.cfg.callback_policy
        if policy.kind == "rank" and self.members.alive[policy.rank]:
            return policy.rank
        if self.elche is not None:
            return self.elche.fastest_rank(alive=self.members.alive)
        return self._head()

    # -- reports -----------------------------------------------------------------------------------
    def _on_report(self, report: Report) -> None:
        track = self.windows.get(report.window)
        if track is None or report.rank not in track.expected:
            return  # a void window's report (planned before a loss): its work was given back
        track.reports[report.rank] = report
        assert self.coverage is not None
        self.coverage.record(report.epoch, report.chunks)
        self.epochs[report.epoch].add(report)
        if track.complete:
            self._complete(track)

    def _complete(self, track: WindowTrack) -> None:
        reports = [track.reports[r] for r in sorted(track.reports)]
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
        self.global_step += sum(track.batches)
        self._close_epochs()
        self._fill()
        self._maybe_send_stop()

    def _record_cycle(self, track: WindowTrack, reports: list[Report]) -> None:
        if self.elche is None:
            return
        by_rank = {r.rank: r for r in reports}
        compute = [by_rank[r].compute_ms if r in by_rank else 0.0 for r in range(self.world)]
        batches = [by_rank[r].batches if r in by_rank else 0 for r in range(self.world)]
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

    def _average(self, track: WindowTrack, reports: list[Report]) -> None:
        from flodl.runtime.averaging import weighted_mean  # torch only where averaging happens

        batches = [r.batches for r in reports]
        weights = averaging_weights(batches, self.cfg.elche.gamma)
        bweights = buffer_weights(batches)
        n_params = self.ready[reports[0].rank].n_params
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
        for report in reports:
            self._send(report.rank, Average(track.index, self.center))

    def _progress(self, epoch: EpochTrack) -> None:
        cursor = self.cursors.get(epoch.epoch)
        total = cursor.n_samples if cursor is not None else 0
        loss = epoch.loss_sum / epoch.loss_count if epoch.loss_count else None
        self.hooks.on_progress(epoch.epoch, epoch.samples, total, loss, shares(epoch.batches))

    # -- epochs ----------------------------------------------------------------------------------
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
                syncs, self.events[-1] if self.events else None, self.cfg.elche.anchor
            )
            self.closed_epochs.append(metrics)
            self.hooks.on_epoch(metrics)

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
            stopped=self.stop_reason,
            saved=list(self.checkpointer.saved) if self.checkpointer is not None else [],
            lost_ranks=list(self.members.lost),
        )
