"""The controller: plans every window, runs ElChe on what ranks report, aggregates the epochs.

It lives in the launcher and is a single-threaded state machine over one inbox of
``(rank, message)`` events: reader threads, the in-process link and the process supervisor all
post into it. Planning runs one window ahead (``lookahead``) so ranks never wait for a plan;
ElChe therefore sees each window's timings one window late, which it tolerates by design.

Ranks keep their launch index for life; after a loss the survivors form a new process group
(a new *generation*) and the dead rank's unfinished work goes back to its epoch's cursor.

The controller is composed of parts, each owning its state and given what it needs:

=====================================================  =======================================
part                                                   owns
=====================================================  =======================================
:class:`~flodl.runtime.wire.rank_link.Outbound`                 the links to the ranks (sending)
:class:`~flodl.runtime.controller.membership.Membership`          the alive mask, generation,
heartbeats
:class:`~flodl.runtime.controller.planning.Planner`               cursors, open windows, epochs,
coverage
:class:`~flodl.runtime.controller.aggregation.Aggregator`         sync-event log, closed epochs,
averages
:class:`~flodl.runtime.controller.checkpointing.Checkpointing`    bundles, keep-best, the save error
:class:`~flodl.runtime.controller.opening.Opening`                the Ready messages, the resume
point
:class:`~flodl.runtime.controller.elastic.Elastic`                liveness, failures, losses,
regroups
=====================================================  =======================================

This class wires them, routes each message to its part, and owns the stop. It is the one reader
of the whole ``TrainerConfig``: each part gets its slice (the ``ElCheConfig``, ``save_best``,
``max_failure``, a :class:`~flodl.runtime.controller.planning.PlanningConfig`, plain values).
What it exchanges with the launcher besides the ranks' messages (hooks, posted events) is in
``events.py``.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

from flodl.config import TrainerConfig
from flodl.monitor.callbacks import EarlyStopping
from flodl.monitor.metrics import EpochMetrics
from flodl.runtime.controller.aggregation import Aggregator
from flodl.runtime.controller.checkpointing import Checkpointing, CommitFacts
from flodl.runtime.controller.elastic import Elastic
from flodl.runtime.controller.events import Disconnected, Exited, Hooks, RunFailed
from flodl.runtime.controller.membership import Membership, failure_budget
from flodl.runtime.controller.opening import Opening, make_elche
from flodl.runtime.controller.planning import Planner, PlanningConfig
from flodl.runtime.controller.snapshots import Checkpointer, ResumePoint
from flodl.runtime.controller.tracking import ControllerResult, WindowTrack
from flodl.runtime.wire import chaos
from flodl.runtime.wire.messages import (
    EvalResult,
    Final,
    Heartbeat,
    RankError,
    RankState,
    Ready,
    Regrouped,
    Report,
    Settled,
    Stop,
)
from flodl.runtime.wire.rank_link import Outbound

log = logging.getLogger(__name__)

_EXIT_WAIT_S = 0.5  # a closed channel waits this long for its process's exit status
_DEADLINES_S = 0.005  # how often the deadlines are looked at (see check_deadlines)

__all__ = ["Controller", "ControllerResult", "Disconnected", "Exited", "Hooks", "RunFailed"]


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
        eval_metric: str | None = None,
        batch_sizes: Sequence[int | None] = (),
    ) -> None:
        """``batch_sizes``: each rank's, as the placement configured them (the Topology's)."""
        self.cfg, self.world = config, world_size
        self.hooks = hooks or Hooks()
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.out = Outbound()
        budget = failure_budget(config.max_failure, world_size)
        self.members = Membership(world_size, budget, config.cluster.heartbeat_timeout_s)
        self.elche = make_elche(config.elche, world_size, speeds, resume)
        step = resume.meta.global_step if resume is not None else 0
        parts = (self.members, self.elche, checkpointer, self.out)
        plan = PlanningConfig.of(config)
        self.planner = Planner(
            plan, has_eval, *parts, lookahead=lookahead, global_step=step, placed=batch_sizes
        )
        saved = resume.controller_state() if resume is not None else None
        self.aggregator = Aggregator(
            config.elche, world_size, self.elche, self.hooks, self.out, eval_metric, saved
        )
        epochs, ratio = config.num_epochs, config.lr_scale_ratio
        self.opening = Opening(epochs, ratio, world_size, self.members, self.out, resume)
        self.saves = Checkpointing(config.save_best, checkpointer, self._facts, self._stop_for_save)
        self.elastic = Elastic(
            config.max_failure, self.members, self.planner, self.saves, self.out, self, self._kill
        )
        self.final: Final | None = None
        self.stop_reason: str | None = None
        self.stopped_early: dict[str, Any] | None = None
        stopping = config.early_stopping
        self.early_stopping = EarlyStopping(stopping) if stopping is not None else None
        self.rounds_before = resume.meta.sync_round if resume is not None else 0
        self._stop_sent, self._stop_deadline = False, 0.0  # Stop went out; when it must be done
        self._t_start = time.perf_counter()
        self._t_train = self._t_end = 0.0  # training began; its last window completed
        self._deadlines_at = -math.inf  # when check_deadlines last looked
        self._hung_up: dict[int, tuple[float, str]] = {}  # rank: (when lost, why), awaiting exit

    @property
    def alive(self) -> list[int]:
        return self.members.members

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, rank: int, link: Any) -> None:
        self.out.attach(rank, link)

    def post(self, rank: int, msg: Any) -> None:
        # Liveness is stamped when a message arrives (reader threads), not when this thread gets
        # to it: a slow callback or checkpoint write here must not make healthy ranks look dead.
        self.members.seen(rank)
        self.inbox.put((rank, msg))

    def route(self, msg: Any, descriptors: list) -> dict:
        """For the launcher's readers: a cpu_* snapshot is summed as it arrives (no copy)."""
        return self.aggregator.route(msg, descriptors)

    # -- main loop -------------------------------------------------------------------------------
    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> ControllerResult:
        while not self.finished():
            if stop_requested() and self.stop_reason is None:
                self.begin_stop("interrupted")
            if self.stop_reason is not None and time.perf_counter() > self._stop_deadline:
                raise KeyboardInterrupt  # ranks did not wind down in time: tear them down
            self.check_deadlines()
            try:
                rank, msg = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            self.handle(rank, msg)
        return self.result()

    # The per-message steps of run(), public for a driver of its own (flodl/sim, the tests):
    # finished(), check_deadlines(), then handle() each message, and result() at the end.
    def handle(self, rank: int, msg: Any) -> None:
        """Handle one message from ``rank``, as :meth:`run` does; warn when that kept this thread
        (the liveness judge) busy."""
        t0 = time.monotonic()
        self._dispatch(rank, msg)
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

    def finished(self) -> bool:
        """Whether the run is over: the final weights in, nothing planned, saved or regrouping."""
        if self.final is None:  # asked before every message: the cheap test first
            return False
        if self.planner.windows or self.saves.pending or self.elastic.regrouping:
            return False
        return self.stop_reason is not None or not self.planner.open

    def check_deadlines(self) -> None:
        """Judge liveness, lost starts and hang-ups (every :data:`_DEADLINES_S` at most)."""
        # Every message passes here (128 reports a window at 128 ranks): the deadlines are
        # looked at every _DEADLINES_S, far finer than any of them (heartbeat, grace, start).
        now = time.perf_counter()
        if now - self._deadlines_at < _DEADLINES_S:
            return
        self._deadlines_at = now
        self.elastic.excuse_stalls()
        if self._hung_up:
            self._hang_ups_due(now)
        self.elastic.failure_due(now)
        timeout = self.cfg.cluster.start_timeout_s
        if self.planner.coverage is None and now - self._t_start > timeout:
            missing = self.opening.missing()
            if missing:
                raise RunFailed(f"ranks {missing} did not get ready within {timeout:.0f} s")
        if not self._stop_sent:
            self.elastic.judge(now)

    def _dispatch(self, rank: int, msg: Any) -> None:
        if self.planner.coverage is None:
            self.elastic.tell_if_late(rank)
        if isinstance(msg, Report):  # the most frequent first: a report a rank a window
            self._on_report(msg)
        elif isinstance(msg, Settled):
            self._on_settled(msg)
        elif isinstance(msg, Heartbeat):
            return
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, EvalResult):
            self._on_eval(msg)
        elif isinstance(msg, Final):
            self._on_final(msg)
        elif isinstance(msg, RankState):
            self.saves.on_rank_state(msg)
        elif isinstance(msg, Regrouped):
            self.elastic.on_regrouped(msg)
        elif isinstance(msg, RankError):
            self._on_rank_error(msg)
        elif isinstance(msg, Exited):
            self._on_exit(rank, msg)
        elif isinstance(msg, Disconnected) and not self._stop_sent:
            # A dead process closes its channel before the supervisor sees it exit: wait a
            # moment for its exit status, which says more (a signal, an OOM kill).
            self._hung_up.setdefault(rank, (time.perf_counter() + _EXIT_WAIT_S, msg.reason))

    def _hang_ups_due(self, now: float) -> None:
        """Channels closed with no exit status after :data:`_EXIT_WAIT_S` (a remote rank
        whose host went away, a cohort that does not supervise processes): lost as such."""
        for rank, (due, reason) in list(self._hung_up.items()):
            if now >= due and not self._stop_sent:
                del self._hung_up[rank]
                self.elastic.on_failure(rank, f"rank {rank} lost its control channel ({reason})")

    def _on_rank_error(self, msg: RankError) -> None:
        """A rank's own exception. The user's code (or the non-finite policy) failing is the
        job's failure, at once and by the first rank to report it: it would happen on every
        rank in turn, and regrouping around it only hides it. ``trainer.on_rank_error=drop``
        loses the rank instead, as does any other exception (a device's)."""
        message = f"rank {msg.rank} failed: {msg.message}"
        if msg.blame and self.cfg.on_rank_error == "fail":
            raise RunFailed(message)
        self.elastic.on_failure(msg.rank, message, immediate=True)

    def _on_exit(self, rank: int, msg: Exited) -> None:
        # After Stop, a clean exit is the normal end (rank 0 only once its state arrived).
        head = self.planner.head()
        self._hung_up.pop(rank, None)  # the exit status says more than the closed channel
        if msg.code == 0 and self._stop_sent and (self.final is not None or rank != head):
            return
        detail = f": {msg.tail}" if msg.tail else ""
        self.elastic.on_failure(rank, f"rank {rank} {msg.describe()}{detail}")

    def _on_final(self, msg: Final) -> None:
        """The final weights arrived: release the ranks held in case their sender was lost."""
        self.final = msg
        for rank in self.alive:
            if rank != msg.rank:
                self.out.send(rank, Stop(self.stop_reason or "done"))

    # -- the Host protocol of the membership part (flodl.runtime.controller.elastic) --
    def formed(self) -> bool:
        return self.planner.coverage is not None and self.opening.all_ready()

    def _kill(self, rank: int) -> None:
        self.hooks.kill_rank(rank)  # read when called: a cohort sets the hook after construction

    def stopping(self) -> bool:
        return self._stop_sent

    def final_in(self) -> bool:
        return self.final is not None

    def not_ready(self, rank: int) -> None:
        self.opening.forget(rank)

    def closed_count(self) -> int:
        return len(self.aggregator.closed_epochs)

    def forget_references(self) -> None:
        self.aggregator.forget_references()

    def resume_planning(self) -> None:
        self._fill()
        self._maybe_send_stop()

    def close_epochs(self) -> None:
        self.aggregator.close_epochs(self.planner.epochs, self._after_epoch)

    def _fill(self) -> None:
        self.planner.fill(paused=self.stop_reason is not None or bool(self.elastic.regrouping))

    def current_stop(self) -> str | None:
        return self.stop_reason

    # -- evaluation and epochs -------------------------------------------------------------------
    def _on_eval(self, msg: EvalResult) -> None:
        if self.planner.take_eval(msg):
            self.close_epochs()
            self._fill()  # planning may have waited for this verdict (early stopping)

    def _after_epoch(self, epoch: int, metrics: EpochMetrics, request: str | None) -> None:
        """Keep-best and early stopping on a closed epoch; a stop request stops every rank."""
        self.saves.observe(epoch, metrics)
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
        if not self.formed():
            raise KeyboardInterrupt  # nothing trained yet: nothing to save
        self._maybe_send_stop()

    def _stop_for_save(self, reason: str) -> None:
        if self.stop_reason is None:  # a save failed mid-run
            self.begin_stop(reason)

    def _maybe_send_stop(self) -> None:
        if self._stop_sent or self.planner.windows or self.elastic.regrouping:
            return
        if self.stop_reason is None and not self.planner.all_planned:
            return
        self._stop_sent = True
        head = self.planner.head()
        tag = self.saves.open_final(self.stop_reason or "final", self.alive, head)
        self.release_controller_state()
        for rank in self.alive:
            stop = Stop(
                self.stop_reason or "done",
                send_state=rank == head,
                checkpoint=bool(tag),
                save_tag=tag,
                write_weights=rank == head,
                hold=rank != head,
            )
            self.out.send(rank, stop)

    def release_controller_state(self) -> None:
        """At Stop (no window in flight, none to come): the EASGD centre and the outer momentum
        go into every pending save now and are dropped, so the launcher never holds them next
        to the final weights that are about to arrive (cpu_async: one copy less at its peak)."""
        state = self.aggregator.state()
        if state is not None and self.saves.write_controller_state(state):
            del state
            self.aggregator.release()

    def _facts(self, save_epoch: int | None) -> CommitFacts:
        """What a bundle committed now records (``save_epoch``: None at the end or a stop)."""
        planner = self.planner
        assert planner.coverage is not None
        uncovered: list = []
        if save_epoch is not None:  # an epoch-boundary checkpoint: the epoch is complete
            epoch = save_epoch
        else:  # the end of the run, or a stop: the lowest unfinished epoch is the resume point
            epoch, uncovered = planner.resume_point()
        return CommitFacts(
            epoch=epoch,
            uncovered=uncovered,
            controller_state=self.aggregator.state(),
            lost_ranks=list(self.members.lost),
            launch_world=self.world,
            global_step=planner.global_step,
            sync_round=self.rounds_before + planner.completed,
            elche_state=self.elche.state().to_dict() if self.elche is not None else None,
            n_samples=planner.coverage.n_samples,
        )

    # -- start -----------------------------------------------------------------------------------
    def _on_ready(self, msg: Ready) -> None:
        if self.opening.take(msg):
            self.maybe_begin()

    def maybe_begin(self) -> None:
        """Start training once every member is ready."""
        if self.planner.coverage is not None or not self.opening.all_ready():
            return
        start = self.opening.start()
        for ready in sorted(start.ready, key=lambda r: r.rank):
            if ready.memory_plan:
                log.info("memory plan: %s", ready.memory_plan)
        self.saves.sign(start.signature)
        self._t_train = time.perf_counter()
        self.aggregator.begin(self._t_train, start.ready[0].n_params)
        self.planner.start(start.n_samples, start.at, start.ready)

    # -- reports -----------------------------------------------------------------------------------
    def _on_report(self, report: Report) -> None:
        track = self.planner.record(report)
        if track is None:
            return  # a void window's report (planned before a loss): its work was given back
        if report.steps:
            self.hooks.on_steps(report.rank, report.steps)
        if track.complete:
            self.complete(track)

    def _on_settled(self, msg: Settled) -> None:
        if self.planner.settle(msg.window, msg.rank):
            self.close_epochs()
            self._fill()  # planning may have waited for this epoch to close (early stopping)
            self._maybe_send_stop()

    def complete(self, track: WindowTrack) -> None:
        """Every expected report of ``track`` is in: aggregate it, then plan on."""
        if not self.cfg.elche.mode.via_controller and self.world > 1:
            self.elastic.remember(track)  # until its averaging is known to have held
        verdict = self.aggregator.complete(track)
        if verdict is not None:
            self.planner.on_verdict(verdict)
        now = time.perf_counter()
        epoch = self.planner.finish(track, now)
        self.aggregator.progress(epoch, self.planner.epoch_samples(epoch.epoch))
        if epoch.all_planned and epoch.done == epoch.planned:
            self._t_end = now
        self.close_epochs()
        self._fill()
        self._maybe_send_stop()

    def result(self) -> ControllerResult:
        """What the run did: final weights, epochs, events, coverage, per-rank totals."""
        tracks = list(self.planner.epochs.values())
        ranks = range(self.world)
        rank_samples = [sum(t.rank_samples[r] for t in tracks) for r in ranks]
        return ControllerResult(
            final=self.final,
            epochs=self.aggregator.closed_epochs,
            events=self.aggregator.events,
            coverage=self.planner.coverage,
            train_s=max((self._t_end or time.perf_counter()) - self._t_train, 1e-9),
            samples=sum(rank_samples),
            rank_samples=rank_samples,
            rank_batches=[sum(t.batches[r] for t in tracks) for r in ranks],
            rank_compute_ms=[sum(t.compute_ms[r] for t in tracks) for r in ranks],
            rank_data_ms=[sum(t.data_ms[r] for t in tracks) for r in ranks],
            rank_overrun_ms=[sum(t.overrun_ms[r] for t in tracks) for r in ranks],
            rank_peak_mem=[max((t.peak_mem[r] for t in tracks), default=0) for r in ranks],
            stopped_early=self.stopped_early,
            best=self.saves.best.to_dict() if self.saves.best is not None else None,
            devices=self.opening.devices(),
            calibrated_step_ms=self.opening.calibrated_step_ms(),
            memory_plans=self.opening.memory_plans(),
            stopped=self.stop_reason,
            saved=self.saves.saved,
            lost_ranks=list(self.members.lost),
            save_error=self.saves.save_error,
            averaging=self.aggregator.wire_bytes(),
        )
