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
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flodl import shards
from flodl.callbacks import EarlyStopping, Watch
from flodl.config import TrainerConfig
from flodl.elche import (
    ElChe,
    ElCheState,
)
from flodl.metrics import EpochMetrics, SyncEvent
from flodl.runtime import chaos
from flodl.runtime.aggregation import Aggregation
from flodl.runtime.dispatch import Coverage, EpochCursor
from flodl.runtime.membership import Membership, failure_budget
from flodl.runtime.messages import (
    EvalResult,
    Final,
    Heartbeat,
    RankError,
    RankState,
    Ready,
    Regroup,
    Regrouped,
    Report,
    Settled,
    Stop,
)
from flodl.runtime.planning import Planning
from flodl.runtime.snapshots import Checkpointer, PendingSave, ResumePoint, ShardWriteFailed
from flodl.runtime.sums import SnapshotSums
from flodl.runtime.tracking import ControllerResult, EpochTrack, WindowTrack

log = logging.getLogger(__name__)
_STALL_S = 1.0  # a gap between two liveness checks longer than this is the judge's own stall
_LIVENESS_S = 0.05  # how often silent ranks are looked for

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
    # A closed epoch; a returned string is a stop request (its reason).
    on_epoch: Callable[[EpochMetrics], str | None] = lambda m: None
    on_steps: Callable[[int, tuple], None] = lambda rank, steps: None
    on_progress: Callable[[int, int, int, float | None, list[float]], None] = (
        lambda epoch, done, total, loss, shares: None
    )
    kill_rank: Callable[[int], None] = lambda rank: None


class Controller(Planning, Aggregation):
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
        eval_metric: str | None = None,
    ) -> None:
        self.cfg = config
        self.eval_metric = eval_metric
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
        self.sums = SnapshotSums(config.elche.gamma) if self.mode.via_controller else None
        self.outer: Any = None
        self.overshoot = (0, 0, 0)  # cpu_async: (current, initial, cap) averages in flight
        self.batch_sizes = [config.batch_size] * world_size
        self.global_step = resume.meta.global_step if resume is not None else 0
        self.rounds_before = resume.meta.sync_round if resume is not None else 0
        self.stop_reason: str | None = None
        self.regrouping: dict[int, bool] = {}
        self._stop_sent = False
        self._stop_deadline = 0.0
        self._failure: tuple[float, str, int | None] | None = None
        self._told: dict[int, int] = {}  # the membership generation each rank was told
        self._recent: dict[int, WindowTrack] = {}  # completed windows, averaging in flight
        self._unaveraged: dict[int, set[int]] = {}  # window -> survivors whose averaging failed
        self._settle_windows: dict[int, int] = {}  # an epoch's last window -> the epoch
        self.save_error: str | None = None  # set when a bundle could not be written
        stopping, best = config.early_stopping, config.save_best
        self.early_stopping = EarlyStopping(stopping) if stopping is not None else None
        self.best = Watch(best, "trainer.save_best") if best is not None else None
        self._best_verdicts: dict[int, bool] = {}  # epoch -> improved?
        self._committed_epoch: int | None = None  # epochs done in the bundle at save_path
        self.stopped_early: dict[str, Any] | None = None
        self._t_start = time.perf_counter()
        self._last_check = time.monotonic()
        self._last_liveness = 0.0
        self._t_train = 0.0
        self._t_end = 0.0
        self._restore_controller_state()

    def _restore_controller_state(self) -> None:
        """cpu_* modes: the EASGD centre and the outer momentum the bundle holds."""
        saved = self.resume.controller_state() if self.resume is not None else None
        if not saved:
            return
        self.center = saved.get("center")
        if saved.get("outer_previous") is not None:
            from flodl.runtime.outer import make_outer

            self.outer = make_outer(self.cfg.elche, int(saved["outer_previous"].numel()))
            if self.outer is not None:
                self.outer.previous = saved["outer_previous"].clone()
                buffer = saved.get("outer_buffer")
                self.outer.buffer = buffer.clone() if buffer is not None else None

    def _make_elche(self, speeds: list[float]) -> ElChe | None:
        if self.world < 2:
            return None
        hint = speeds if len(set(speeds)) > 1 else None
        saved = self.resume.meta.elche_state if self.resume is not None else None
        state = ElCheState.from_dict(saved) if saved else None
        if state is not None and state.world_size != self.world:
            log.warning(
                "checkpoint %s: ElChe state of %d ranks, this run has %d: re-calibrating",
                self.resume.stem if self.resume is not None else "",
                state.world_size,
                self.world,
            )
            state = None
        return ElChe(self.cfg.elche, self.world, speed_hint=hint, state=state)

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, rank: int, link: Any) -> None:
        self.links[rank] = link

    def post(self, rank: int, msg: Any) -> None:
        # Liveness is stamped when a message arrives (reader threads), not when this thread gets
        # to it: a slow callback or checkpoint write here must not make healthy ranks look dead.
        self.members.seen(rank)
        self.inbox.put((rank, msg))

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
            self._handle_timed(rank, msg)
        return self._result()

    def _handle_timed(self, rank: int, msg: Any) -> None:
        """Handle one message; warn when that kept this thread (the liveness judge) busy."""
        t0 = time.monotonic()
        self._handle(rank, msg)
        busy = time.monotonic() - t0
        if busy > self.members.heartbeat_timeout_s / 2:
            log.warning(
                "the controller was busy %.1f s handling %s from rank %d (a slow metrics_fn, "
                "callback or checkpoint write?); ranks are judged by when their heartbeats "
                "arrived, so none was dropped for it",
                busy,
                type(msg).__name__,
                rank,
            )

    def _finished(self) -> bool:
        saving = self.checkpointer is not None and self.checkpointer.pending
        if self.final is None or self.windows or saving or self.regrouping:
            return False
        return self.stop_reason is not None or not self._open()

    def _open(self) -> bool:
        return any(not t.closed for t in self.epochs.values())

    def _check_deadlines(self) -> None:
        self._excuse_stalls()
        now = time.perf_counter()
        if self._failure is not None and now >= self._failure[0]:
            self._deferred_failure_due()
        timeout = self.cfg.cluster.start_timeout_s
        if self.coverage is None and now - self._t_start > timeout:
            missing = sorted(set(self.alive) - set(self.ready))
            if missing:
                raise RunFailed(f"ranks {missing} did not get ready within {timeout:.0f} s")
        # Liveness is O(ranks): judged every _LIVENESS_S, not on every message (a 128-rank
        # window brings 128 reports), which is far finer than any heartbeat timeout.
        if not self._stop_sent and now - self._last_liveness >= _LIVENESS_S:
            self._last_liveness = now
            for rank in self.members.stale():
                log.warning(
                    "rank %d: no heartbeat for %.0f s; dropping it",
                    rank,
                    self.members.heartbeat_timeout_s,
                )
                self.hooks.kill_rank(rank)
                if self._formed():
                    self._lose(rank, "heartbeat went stale")
                else:
                    self._lose_early(rank, "heartbeat went stale")

    def _deferred_failure_due(self) -> None:
        """A rank exited or hung up without an error of its own: before training began that
        is a lost rank, survived like any other while ``trainer.max_failure`` allows."""
        assert self._failure is not None
        _, message, rank = self._failure
        self._failure = None
        if rank is None or self._stop_sent:
            raise RunFailed(message)
        if self._formed():
            self._lose(rank, message)
        else:
            self._lose_early(rank, message)

    def _lose_early(self, rank: int, why: str) -> None:
        """Lose ``rank`` before the cohort formed: the others re-form without it and meet
        again (the same weights, a new calibration); training then starts without it."""
        if not self.members.lose(rank):
            return
        self.ready.pop(rank, None)
        if not self.alive:
            raise RunFailed(f"every rank was lost before training began; last: {why}")
        if self.members.over_budget:
            raise RunFailed(
                f"{why}; trainer.max_failure={self.cfg.max_failure} allows "
                f"{self.members.budget} lost rank(s) and nothing is trained yet to save"
            )
        log.warning(
            "lost rank %d before training began (%s); %d rank(s) go on",
            rank,
            why,
            len(self.alive),
        )
        for r in self.alive:
            self._tell_membership(r)
        self._maybe_begin()

    def _tell_membership(self, rank: int) -> None:
        members = tuple(self.alive)
        weights = {r: 1.0 / len(members) for r in members}
        self._told[rank] = self.members.generation
        self._send(rank, Regroup(self.members.generation, members, -1, weights))

    def _excuse_stalls(self) -> None:
        """A gap between two checks longer than a heartbeat interval means this process did not
        run (SIGSTOP, a swapped-out VM) or this thread was blocked: heartbeats may be sitting
        unread in the sockets, so the gap does not count as the ranks' silence."""
        now = time.monotonic()
        gap = now - self._last_check
        self._last_check = now
        if gap > _STALL_S:
            self.members.excuse(gap)

    def _handle(self, rank: int, msg: Any) -> None:
        told = self.coverage is not None or self._told.get(rank, 0) >= self.members.generation
        if not told and rank in self.alive:  # joined late, after a rank was lost
            self._tell_membership(rank)  # membership first
        if isinstance(msg, Report):
            self._on_report(msg)
        elif isinstance(msg, Heartbeat):
            return
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, EvalResult):
            self._on_eval(msg)
        elif isinstance(msg, Final):
            self._on_final(msg)
        elif isinstance(msg, RankState):
            self._on_rank_state(msg)
        elif isinstance(msg, Settled):
            self._on_settled(msg)
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
        if self._stop_sent and self._formed() and self._lose_while_stopping(rank, message):
            return
        if not self._formed() or self._stop_sent:
            # A rank's own error before the cohort forms (the same on every rank, typically)
            # fails the job fast; a rank that just went away is a loss (see _deferred_failure_due).
            if immediate:
                raise RunFailed(message)
            self._defer_failure(message, None if self._stop_sent else rank)
            return
        self._lose(rank, message)

    def _formed(self) -> bool:
        return self.coverage is not None and set(self.alive) <= set(self.ready)

    def _defer_failure(self, message: str, rank: int | None, grace_s: float = 1.0) -> None:
        # Give the rank's own error message (already on its way) a moment to arrive first.
        if self._failure is None:
            self._failure = (time.perf_counter() + grace_s, message, rank)

    def _lose_while_stopping(self, rank: int, why: str) -> bool:
        """A rank lost after Stop (True: handled). If it owed the final weights, the next
        survivor, held until now with the same weights, sends them (and writes the save's)."""
        sender = self.final is None and rank == self._head()
        if sender and len(self.alive) < 2:
            return False  # the final weights are gone with the last rank: fail with its message
        if not self.members.lose(rank):
            return True
        log.warning("lost rank %d while stopping (%s)", rank, why)
        self._saves_after_loss(rank)
        if sender:
            self._hand_over_final(rank)
        return True

    def _hand_over_final(self, lost: int) -> None:
        """Ask the new head for the final weights, and for the save's weights if it writes
        them now (every survivor holds the last average; cpu_async: its own EASGD blend)."""
        head = self._head()
        log.warning(
            "rank %d, which was sending the final weights, was lost; rank %d sends them", lost, head
        )
        save = self.checkpointer.pending.get(-1) if self.checkpointer is not None else None
        rewrite = save is not None and save.writer == head
        self._send(
            head,
            Stop(
                self.stop_reason or "done",
                send_state=True,
                checkpoint=rewrite,
                save_tag=save.tag if save is not None and rewrite else "",
                write_weights=rewrite,
            ),
        )

    def _on_final(self, msg: Final) -> None:
        """The final weights arrived: release the ranks held in case their sender was lost."""
        self.final = msg
        for rank in self.alive:
            if rank != msg.rank:
                self._send(rank, Stop(self.stop_reason or "done"))

    def _lose(self, rank: int, why: str) -> None:
        if not self.members.lose(rank):
            return
        log.warning("lost rank %d (%s); %d rank(s) go on", rank, why, len(self.alive))
        for epoch in self.epochs.values():
            epoch.unsettled.discard(rank)  # its acknowledgement will never come
        if not self.alive:
            raise RunFailed(f"every rank was lost; last: {why}")
        first_open = self.completed_index()
        members = tuple(self.alive)
        self.regrouping = {r: False for r in members}  # no planning until survivors regroup
        self._lose_eval(rank, first_open)
        self._void_windows(rank, first_open)
        self._saves_after_loss(rank)
        self._close_epochs()
        weights = {r: 1.0 / len(members) for r in members}
        for r in members:
            self._send(r, Regroup(self.members.generation, members, first_open, weights))

    def _lose_eval(self, dead: int, first_open: int) -> None:
        """A lost rank's pending eval shard: the epoch's eval is skipped (a replanned last
        window plans its eval afresh), so no epoch waits forever for a shard that cannot come."""
        for track in self.epochs.values():
            replanned = track.eval_window in self.windows and track.eval_window != first_open
            if not replanned and track.lose_eval(dead):
                log.warning(
                    "rank %d was lost before its eval of epoch %d arrived: that epoch's eval "
                    "is skipped",
                    dead,
                    track.epoch + 1,
                )

    def completed_index(self) -> int:
        """Index of the oldest window not completed yet (every later one is open too)."""
        return min(self.windows, default=self.next_window)

    def _void_windows(self, dead: int, first_open: int) -> None:
        """The dead rank's work in open windows is lost. Later windows are void: what survivors
        already reported there (cpu_async runs ahead) stays trained, the rest is given back."""
        assert self.coverage is not None
        for index in sorted(self.windows):
            track = self.windows[index]
            if self.checkpointer is not None and (index != first_open or track.chunks[dead]):
                self.checkpointer.void(index)  # its epoch is not complete any more: re-planned
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
        if msg.unaveraged >= 0:
            self._unaveraged.setdefault(msg.unaveraged, set()).add(msg.rank)
        if msg.generation != self.members.generation or msg.rank not in self.regrouping:
            return
        self.regrouping[msg.rank] = True
        if not all(self.regrouping.values()):
            return
        self.regrouping = {}
        self._take_back_unaveraged()
        if self.members.over_budget:
            self.begin_stop("max_failure")
            return
        if len(self.alive) == 1:
            log.warning("rank %d goes on alone", self.alive[0])
        self._fill()
        self._maybe_send_stop()

    # -- evaluation and callbacks -------------------------------------------------------------
    def _on_eval(self, msg: EvalResult) -> None:
        track = self.epochs.get(msg.epoch)
        if track is None or not track.take_eval(msg.rank, msg.window, msg.shard, msg.parts):
            return
        if not track.eval_skipped:
            from flodl.evaluation import merge  # torch only where metrics are computed

            track.eval_metrics = merge([track.eval_parts[s] for s in sorted(track.eval_parts)])
        track.eval_parts = {}
        self._close_epochs()
        self._fill()  # planning may have waited for this verdict (early stopping)

    def _after_epoch(self, epoch: int, metrics: EpochMetrics, request: str | None) -> None:
        """Keep-best and early stopping on a closed epoch; a stop request stops every rank."""
        if self.best is not None:
            self._best_verdicts[epoch] = bool(self.best.observe(metrics))
            self._write_best(epoch)
        reason = request
        if self.early_stopping is not None and self.early_stopping.should_stop(metrics):
            reason = reason or "early_stopping"
        if reason is None or self.stop_reason is not None or epoch + 1 >= self.cfg.num_epochs:
            return
        log.info("stopping after epoch %d (%s)", epoch + 1, reason)
        self.stopped_early = {"reason": reason, "epoch": epoch + 1}
        self.begin_stop(reason)

    # -- stopping --------------------------------------------------------------------------------
    def begin_stop(self, reason: str, grace_s: float = 8.0) -> None:
        """Stop dispatching; once in-flight windows are averaged, save (if set up) and end."""
        if self.stopped_early is None:
            log.warning("stopping (%s): finishing in-flight windows", reason)
        chaos.point("stop")
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
        head, tag = self._head(), ""
        if self.checkpointer is not None and self.checkpointer.enabled and self.save_error is None:
            reason = self.stop_reason or "final"
            tag = self.checkpointer.open(-1, reason, None, self.alive, writer=head).tag
        self._release_controller_state()
        for rank in self.alive:
            stop = Stop(
                self.stop_reason or "done",
                send_state=rank == head,
                checkpoint=bool(tag),
                save_tag=tag,
                write_weights=rank == head,
                hold=rank != head,
            )
            self._send(rank, stop)

    # -- checkpoints -----------------------------------------------------------------------------
    def _on_rank_state(self, msg: RankState) -> None:
        assert self.checkpointer is not None
        try:
            save = self.checkpointer.collect(msg)
            if save is not None:
                self._commit(save)
        except Exception as exc:
            self._save_failed(exc, mid_run=msg.window >= 0)

    def _saves_after_loss(self, rank: int) -> None:
        if self.checkpointer is None:
            return
        successor = self._head() if self._stop_sent else None
        try:
            for save in self.checkpointer.lose(rank, successor):
                self._commit(save)
        except Exception as exc:
            self._save_failed(exc, mid_run=not self._stop_sent)

    def _save_failed(self, exc: Exception, mid_run: bool) -> None:
        """A bundle could not be written: never lose what was trained. Stop cleanly; the trained
        state still reaches the launcher (Final), which writes it to the job directory."""
        from flodl.failures import describe

        assert self.checkpointer is not None
        detail = str(exc) if isinstance(exc, ShardWriteFailed) else describe(exc)
        self.save_error = f"saving a checkpoint to {self.checkpointer.stem} failed: {detail}"
        log.error("%s; stopping", self.save_error)
        if mid_run and self.stop_reason is None:
            self.begin_stop("checkpoint save failed")

    def _resume_point(self) -> tuple[int, list]:
        for epoch in sorted(self.cursors):
            if not self.cursors[epoch].done:
                return epoch, list(self.cursors[epoch].ranges)
        return max(self.cursors, default=-1) + 1, []

    def _write_best(self, epoch: int) -> None:
        """Once an evaluated epoch has both its verdict and its committed bundle: if it was the
        best so far, copy that bundle to ``<save_path>_best``."""
        if epoch not in self._best_verdicts:
            return
        if self._committed_epoch is None or self._committed_epoch < epoch + 1:
            return  # its bundle is still being written; _commit calls again
        improved = self._best_verdicts.pop(epoch)
        if not improved:
            return
        assert self.checkpointer is not None and self.checkpointer.stem is not None
        if self._committed_epoch != epoch + 1:
            log.warning("epoch %d was the best, but its bundle was replaced before", epoch + 1)
            return
        best = self.checkpointer.stem + "_best"
        shards.copy_bundle(self.checkpointer.stem, best, "best")
        log.info("kept the best bundle %s (epoch %d)", best, epoch + 1)

    def _commit(self, save: PendingSave) -> None:
        """Every expected shard is written: add the controller's own, then the meta."""
        assert self.checkpointer is not None and self.coverage is not None
        chaos.point("checkpoint_write")
        uncovered: list = []
        if save.epoch is not None:  # an epoch-boundary checkpoint: the epoch is complete
            epoch = save.epoch
        else:  # the end of the run, or a stop: the lowest unfinished epoch is the resume point
            epoch, uncovered = self._resume_point()
        controller = self._controller_state()
        if controller is not None and shards.CONTROLLER not in save.written:
            assert self.checkpointer.stem is not None
            save.written[shards.CONTROLLER] = shards.write_shard(
                self.checkpointer.stem, save.tag, shards.CONTROLLER, controller
            )
        self.checkpointer.commit(
            save,
            extra={"lost_ranks": list(self.members.lost), "launch_world": self.world},
            epoch=epoch,
            global_step=self.global_step,
            sync_round=self.rounds_before + self.completed,
            elche_state=self.elche.state().to_dict() if self.elche is not None else None,
            coverage={"epoch": epoch, "n_samples": self.coverage.n_samples, "uncovered": uncovered},
        )
        self._committed_epoch = epoch
        if self.best is not None and save.epoch is not None:
            self._write_best(epoch - 1)

    def _release_controller_state(self) -> None:
        """At Stop (no window in flight, none to come): write the EASGD centre and the outer
        momentum into every pending save now and drop them, so the launcher never holds them
        next to the final weights that are about to arrive (cpu_async: 1 copy less at the peak)."""
        controller = self._controller_state()
        if controller is None:
            return
        if self.checkpointer is not None and self.checkpointer.stem is not None:
            for save in list(self.checkpointer.pending.values()):
                if shards.CONTROLLER in save.written:
                    continue
                try:
                    save.written[shards.CONTROLLER] = shards.write_shard(
                        self.checkpointer.stem, save.tag, shards.CONTROLLER, controller
                    )
                except Exception as exc:  # kept: the commit tries again and reports it
                    log.warning("writing the controller shard at stop failed: %s", exc)
                    return
        del controller
        self.center = self.outer = None

    def _controller_state(self) -> dict[str, Any] | None:
        """cpu_* modes: what only the controller holds (EASGD centre, outer momentum)."""
        if self.center is None and self.outer is None:
            return None
        outer = self.outer
        return {
            "center": self.center,
            "outer_previous": outer.previous if outer is not None else None,
            "outer_buffer": outer.buffer if outer is not None else None,
        }

    # -- start -----------------------------------------------------------------------------------
    def _on_ready(self, msg: Ready) -> None:
        if msg.rank in self.alive:
            self.ready[msg.rank] = msg
            self._maybe_begin()

    def _maybe_begin(self) -> None:
        """Start training once every member is ready."""
        if self.coverage is not None or not set(self.alive) <= set(self.ready):
            return
        signatures = {r.signature for r in self.ready.values()}
        if len(signatures) > 1:
            detail = ", ".join(f"rank {r}: {m.signature}" for r, m in sorted(self.ready.items()))
            raise RunFailed(f"ranks built different model architectures ({detail})")
        sizes = {r.n_samples for r in self.ready.values()}
        if len(sizes) > 1:
            raise RunFailed(f"ranks loaded datasets of different sizes: {sorted(sizes)}")
        n_samples = sizes.pop()
        self.shard_sizes = next(iter(self.ready.values())).shard_sizes
        self.batch_sizes = [  # a rank lost before it was ready gets no work: any size will do
            (self.ready[r].batch_size if r in self.ready else None) or self.cfg.batch_size
            for r in range(self.world)
        ]
        if self.checkpointer is not None:
            self.checkpointer.signature = signatures.pop()
        if self.sums is not None:
            self.sums.n_params = next(iter(self.ready.values())).n_params
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
        saved_world = int(meta.extra.get("launch_world", meta.world_size))
        factor = self._lr_factor(self.world) / self._lr_factor(saved_world)
        for rank in self.alive:
            self._send(rank, self.resume.restore_for(rank, lr_factor=factor))
        return meta.epoch, self.resume.uncovered()

    def _lr_factor(self, world: int) -> float:
        return 1.0 + (world - 1) * self.cfg.lr_scale_ratio

    # -- reports -----------------------------------------------------------------------------------
    def _on_report(self, report: Report) -> None:
        track = self.windows.get(report.window)
        if track is None or report.rank not in track.expected:
            return  # a void window's report (planned before a loss): its work was given back
        track.reports[report.rank] = report
        if report.steps:
            self.hooks.on_steps(report.rank, report.steps)
        assert self.coverage is not None
        self.coverage.record(report.epoch, report.chunks)
        self.epochs[report.epoch].add(report)
        if track.complete:
            self._complete(track)

    def _on_settled(self, msg: Settled) -> None:
        epoch = self._settle_windows.get(msg.window)
        if epoch is not None and epoch in self.epochs:
            track = self.epochs[epoch]
            track.unsettled.discard(msg.rank)
            if track.unsettled:
                return  # O(1) until the last member's: only that one can close the epoch
            self._close_epochs()
            self._fill()  # planning may have waited for this epoch to close (early stopping)
            self._maybe_send_stop()

    def _take_back_unaveraged(self) -> None:
        """A window whose collective averaging failed counted the reports of ranks lost in it,
        but their work never reached the survivors' weights (the regroup re-averages the
        survivors only): give it back, so coverage counts only what the model holds. An epoch
        already closed cannot take work back: its coverage is then recorded short, not exact."""
        for index, failed in sorted(self._unaveraged.items()):
            epoch = self._settle_windows.get(index)
            if epoch is not None and epoch in self.epochs:  # they will not settle it: regrouped
                self.epochs[epoch].unsettled -= failed
            track = self._recent.pop(index, None)
            if track is None:
                continue
            for rank in sorted(set(track.reports) - set(self.alive)):
                self._give_back_settled(track, rank)
        self._unaveraged.clear()
        self._close_epochs()  # (planning resumes right after, in _on_regrouped)

    def _give_back_settled(self, track: WindowTrack, rank: int) -> None:
        assert self.coverage is not None
        chunks = track.chunks[rank]
        closed = track.epoch < min(self.epochs, default=0) + len(self.closed_epochs)
        if closed:
            self.coverage.unrecord(track.epoch, chunks)
            log.warning(
                "rank %d was lost while averaging window %d, the last of epoch %d: its %d "
                "samples there never reached the model; epoch %d's coverage is short",
                rank,
                track.index,
                track.epoch + 1,
                sum(size for _, size in chunks),
                track.epoch + 1,
            )
            return
        log.warning(
            "rank %d was lost while averaging window %d: its work there is trained again",
            rank,
            track.index,
        )
        self._give_back(track, rank)  # the window stays completed; only this work returns

    def _complete(self, track: WindowTrack) -> None:
        reports = [track.reports[r] for r in sorted(track.reports)]
        if not self.mode.via_controller and self.world > 1:
            self._recent[track.index] = track  # until its averaging is known to have held
            for old in [i for i in self._recent if i < track.index - 4]:
                del self._recent[old]
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

    # -- epochs ----------------------------------------------------------------------------------
