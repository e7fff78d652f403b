"""Planning: which rank trains which chunks in each window, and the ledger of that work.

A part of :class:`flodl.runtime.controller.controller.Controller`: the :class:`Planner` owns the
epoch
cursors, the open windows, the epochs' running totals and the coverage; it decides *what* is
dispatched and takes work back when a rank is lost. The controller decides *when* (it calls
:meth:`Planner.fill` with whether planning is paused) and routes the ranks' messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from flodl.config import ElCheConfig, Mode, TrainerConfig
from flodl.elche import (
    ElChe,
    auto_max_overshoot,
    averaging_weights,
    buffer_weights,
    step_max_overshoot,
)
from flodl.elche.guard import Verdict
from flodl.runtime.controller.dispatch import (
    Coverage,
    EpochCursor,
    EvalSchedule,
    clamp_to_samples,
    eval_shards,
)
from flodl.runtime.controller.membership import Membership
from flodl.runtime.controller.snapshots import Checkpointer
from flodl.runtime.controller.tracking import EpochTrack, WindowTrack
from flodl.runtime.wire.messages import CohortPlan, EvalResult, PlannedWindow, Ready, Report
from flodl.runtime.wire.rank_link import Outbound

log = logging.getLogger(__name__)

# A sync-mode plan bundles enough lock-step windows for about this much work, so the controller
# is not on every step's critical path; a one-rank run's windows last about as long.
_SYNC_PLAN_S = 0.25


@dataclass(frozen=True)
class PlanningConfig:
    """What the planner reads of the trainer's configuration (see :meth:`of`)."""

    elche: ElCheConfig  # the mode, anchor, gamma and max_overshoot of the plans
    batch_size: int  # trainer.batch_size: the nominal batch (cursors, auto overshoot)
    accumulate_grad_batches: int  # windows end on whole optimizer steps
    num_epochs: int
    seed: int  # sharded data: the epoch's shard order
    waits_for_verdict: bool  # trainer.early_stopping is set: an epoch waits on the last one
    keeps_best: bool  # trainer.save_best is set: every evaluated epoch is saved
    evals: EvalSchedule

    @classmethod
    def of(cls, cfg: TrainerConfig) -> PlanningConfig:
        return cls(
            elche=cfg.elche,
            batch_size=cfg.batch_size,
            accumulate_grad_batches=cfg.accumulate_grad_batches,
            num_epochs=cfg.num_epochs,
            seed=cfg.seed,
            waits_for_verdict=cfg.early_stopping is not None,
            keeps_best=cfg.save_best is not None,
            evals=EvalSchedule.of(cfg),
        )


def whole_steps(counts: list[int], accumulate: int) -> list[int]:
    """Round each rank's micro-batches up to whole optimizer steps (``accumulate``:
    accumulate_grad_batches), so a window rarely ends inside a group. ElChe's "batch" is a
    micro-batch: it times and counts those; the cursor clips what it hands out to what the epoch
    has left."""
    n = accumulate
    if n == 1:
        return list(counts)
    return [math.ceil(c / n) * n for c in counts]


class Planner:
    """Plans windows over the epoch cursors and keeps the ledger of the work they hand out."""

    def __init__(
        self,
        cfg: PlanningConfig,
        has_eval: bool,
        members: Membership,
        elche: ElChe | None,
        checkpointer: Checkpointer | None,
        out: Outbound,
        lookahead: int = 1,
        global_step: int = 0,
        placed: Sequence[int | None] = (),
    ) -> None:
        """``placed``: each rank's batch size as the placement configured it
        (:mod:`flodl.placement.batches`; ``None``: probed on the rank, which says it in Ready)."""
        world = members.world_size
        self.cfg, self.world, self.mode, self.has_eval = cfg, world, cfg.elche.mode, has_eval
        self.members, self.elche, self.checkpointer, self.out = members, elche, checkpointer, out
        self.lookahead = lookahead
        self.cursors: dict[int, EpochCursor] = {}
        self.epochs: dict[int, EpochTrack] = {}
        self.windows: dict[int, WindowTrack] = {}
        self.coverage: Coverage | None = None  # set when training starts
        self.next_window = 0
        self.completed = 0
        self.all_planned = False
        self.global_step = global_step  # optimizer steps so far (a resumed run's count on)
        self.overshoot = (0, 0, 0)  # cpu_async: (current, initial, cap) averages in flight
        self.placed = [  # a probed size, or none placed: the nominal batch until Ready says
            (placed[r] if r < len(placed) else None) or cfg.batch_size for r in range(world)
        ]
        self.batch_sizes = list(self.placed)  # per rank, from their Ready messages
        self.shard_sizes: tuple[int, ...] = ()  # sharded data: samples per shard, from Ready
        self.sharded_state = False  # some member shards its optimizer state (from Ready)
        self.settle_windows: dict[int, int] = {}  # an epoch's last window -> the epoch
        self.solo_ms = 0.0  # one rank: its measured ms per batch (0: not measured yet)

    @property
    def alive(self) -> list[int]:
        return self.members.members

    def head(self) -> int:
        """The rank that sends the final state: the first survivor."""
        return self.alive[0] if self.alive else 0

    def start(self, n_samples: int, at: tuple[int, list], ready: list[Ready]) -> None:
        """Training starts at epoch ``at[0]`` (``at[1]``: a resumed epoch's uncovered samples);
        ``ready``: the members' Ready messages (batch sizes, shard sizes)."""
        sizes = {r.rank: r.batch_size for r in ready}
        self.batch_sizes = [  # a rank lost before it was ready gets no work: any size will do
            sizes.get(r) or self.placed[r] for r in range(self.world)
        ]
        self.shard_sizes = ready[0].shard_sizes
        self.sharded_state = any(r.sharded_state for r in ready)
        epoch, ranges = at
        self._init_async(n_samples)
        self.coverage = Coverage(n_samples)
        self._new_epoch(epoch, n_samples, ranges)
        self.fill(paused=False)

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

    def on_verdict(self, verdict: Verdict) -> None:
        """cpu_async with an automatic overshoot: ElChe's verdict moves the averages in flight."""
        if self.mode is not Mode.CPU_ASYNC or self.cfg.elche.max_overshoot is not None:
            return
        current, initial, cap = self.overshoot
        self.overshoot = (step_max_overshoot(current, verdict, initial, cap), initial, cap)
        self.lookahead = max(self.lookahead, self.overshoot[0] + 1)

    def _new_epoch(self, epoch: int, n_samples: int, ranges: list | None = None) -> None:
        sizes, bounds = self.shard_sizes, []
        if sizes:  # sharded data: chunks end on shard boundaries (flodl.data.streams)
            from flodl.data.streams import shard_boundaries

            bounds = shard_boundaries(sizes, self.cfg.seed, epoch)
        self.cursors[epoch] = EpochCursor(
            epoch, n_samples, self.cfg.batch_size, list(ranges or []), bounds
        )
        self.epochs[epoch] = EpochTrack(epoch, self.world)

    def fill(self, paused: bool) -> None:
        """Plan until ``lookahead`` windows are in flight (``paused``: stopping or regrouping)."""
        while (
            not paused
            and not self.all_planned
            and self.next_window - self.completed <= self.lookahead
            and not self._awaiting_verdict()
        ):
            self._plan_batch()

    def _awaiting_verdict(self) -> bool:
        """With early stopping, the next epoch waits until the previous one closed (its last
        window and its eval are in): the stop then lands exactly after the epoch that asked for
        it, at the cost of the ranks idling for that last window and the eval."""
        if not self.cfg.waits_for_verdict:
            return False
        return any(t.all_planned and not t.closed for t in self.epochs.values())

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
        planned: list[PlannedWindow] = []
        for _ in range(self._windows_per_plan()):
            cursor = self._cursor()
            if cursor is None:
                break
            planned.append(self._plan_window(cursor))
        if planned:
            plan = CohortPlan(tuple(planned))
            self.out.send_shared(self.alive, plan, plan.for_rank)
        if not self.all_planned and self._cursor() is None:
            self.all_planned = True

    def _counts(self, remaining: int) -> list[int]:
        alive = self.members.alive
        if self.elche is None:
            return [min(remaining, self._solo_batches())]
        if self.mode.is_sync:  # lock-step: one batch each, then average (classic DDP)
            counts, left = [], remaining
            for ok in alive:
                counts.append(1 if ok and left > 0 else 0)
                left -= counts[-1]
            return counts
        return self.elche.window(remaining, alive=alive)

    def _solo_batches(self) -> int:
        """One rank averages with nobody: a window only paces the controller's bookkeeping
        (report, plan, progress), so it lasts about ``_SYNC_PLAN_S`` once a report has measured
        the step (``elche.anchor`` batches at least). Windows of ``anchor`` batches cost a
        ~10-batch MLP run 3-4 % of its time in window boundaries alone."""
        anchor = self.cfg.elche.anchor
        if self.solo_ms <= 0.0:
            return anchor
        return max(anchor, int(_SYNC_PLAN_S * 1000.0 / self.solo_ms))

    def _window_counts(self, cursor: EpochCursor, sizes: list[int]) -> list[int]:
        """ElChe's batch counts (each rank's batches are its own size), clamped to the epoch."""
        if len(set(sizes)) == 1:
            return whole_steps(
                self._counts(cursor.remaining_batches), self.cfg.accumulate_grad_batches
            )
        # ElChe clamps in batches: bound it by the smallest size, then clamp in samples.
        bound = math.ceil(cursor.remaining_samples / min(sizes))
        counts = clamp_to_samples(self._counts(bound), sizes, cursor.remaining_samples)
        return whole_steps(counts, self.cfg.accumulate_grad_batches)

    def _plan_window(self, cursor: EpochCursor) -> PlannedWindow:
        remaining = cursor.remaining_samples
        # The LR clock: derived from epoch and coverage only, so a resumed run lands on it too.
        progress = cursor.epoch * cursor.n_samples + cursor.n_samples - remaining
        sizes = self.batch_sizes
        chunks = cursor.take(self._window_counts(cursor, sizes), sizes)
        batches, samples = [], []  # per rank, in one pass (a window of 128 ranks: 128 entries)
        for rank_chunks, size in zip(chunks, sizes, strict=True):
            n = b = 0
            for _, part in rank_chunks:
                n += part
                b -= -part // size  # ceil: count_batches
            samples.append(n)
            batches.append(b)
        if self.world > 1:
            weights = averaging_weights(samples, self.cfg.elche.gamma)  # ∝ samples ** gamma
            bweights = buffer_weights(batches)
        else:
            weights, bweights = [1.0], [1.0]
        track = self.epochs[cursor.epoch]
        track.planned += 1
        index = self.next_window
        self.next_window += 1
        shards: dict[int, tuple[int, int]] = {}
        save = None
        settle = consensus = False
        if cursor.done:
            # cpu_async: the epoch ends at one set of weights (what is evaluated, saved, returned)
            consensus = self.mode is Mode.CPU_ASYNC and len(self.alive) > 1
            track.all_planned = True
            settle = self.world > 1 and self.mode is not Mode.SOLO and not self.mode.via_controller
            if settle:
                track.unsettled = set(self.alive)
                self.settle_windows[index] = cursor.epoch
            last = cursor.epoch == self.cfg.num_epochs - 1
            evals, members = self.cfg.evals, self.members
            shards = eval_shards(evals, self.has_eval, cursor.epoch, last, members, self.elche)
            track.plan_eval(index, set(shards))
            # save_best: every evaluated epoch is saved too, so the best one can be kept.
            best = bool(shards) and self.cfg.keeps_best
            if self.checkpointer is not None and (
                self.checkpointer.due(cursor.epoch, self.cfg.num_epochs) or best
            ):
                save = self.checkpointer.open(
                    index, "checkpoint", cursor.epoch + 1, self.alive, writer=self.head()
                )
        # nccl_sync: DDP's gradient all-reduce when every member steps (else, at an epoch's
        # tail with fewer batches than ranks, the parameter average as in the other modes).
        # With sharded optimizer state every rank must step its pieces: a rank without a batch
        # joins the all-reduce with a zero gradient (weight 0) instead.
        grads = self.mode is Mode.NCCL_SYNC and len(self.alive) > 1
        grads = grads and (self.sharded_state or all(batches[r] > 0 for r in self.alive))
        self.windows[index] = WindowTrack(
            index, cursor.epoch, batches, list(chunks), set(self.alive)
        )
        alive = self.alive
        if len(alive) == len(chunks):  # everyone: the same dicts, built at C speed
            own = dict(enumerate(chunks))
            pairs = dict(enumerate(zip(weights, bweights, strict=True)))
        else:
            own = {r: chunks[r] for r in alive}
            pairs = {r: (weights[r], bweights[r]) for r in alive}
        return PlannedWindow(
            index,
            cursor.epoch,
            own,
            pairs,
            eval_shards=shards,
            writer=save.writer if save is not None else -1,
            max_overshoot=self.overshoot[0],
            consensus=consensus,
            checkpoint_after=save is not None,
            generation=self.members.generation,
            save_tag=save.tag if save is not None else "",
            settle=settle,
            progress=progress,
            window_samples=remaining - cursor.remaining_samples,
            grad_sync=grads,
        )

    # -- the ledger: what came back, and what goes back when a rank is lost -----------------------
    @property
    def open(self) -> bool:
        """Some epoch is not closed yet."""
        return any(not t.closed for t in self.epochs.values())

    def first_epoch(self) -> int:
        """The first epoch this run trains (a resumed run's is not 0)."""
        return min(self.epochs, default=0)

    def epoch_samples(self, epoch: int) -> int:
        cursor = self.cursors.get(epoch)
        return cursor.n_samples if cursor is not None else 0

    def completed_index(self) -> int:
        """Index of the oldest window not completed yet (every later one is open too)."""
        return min(self.windows, default=self.next_window)

    def record(self, report: Report) -> WindowTrack | None:
        """One rank's report into its window and epoch; its window (None: a void window's)."""
        track = self.windows.get(report.window)
        if track is None or report.rank not in track.expected:
            return None  # a void window's report (planned before a loss): its work came back
        track.reports[report.rank] = report
        assert self.coverage is not None
        self.coverage.record(report.epoch, report.chunks)
        self.epochs[report.epoch].add(report)
        return track

    def finish(self, track: WindowTrack, now: float) -> EpochTrack:
        """A complete window leaves the open ones; its epoch's counts move on."""
        del self.windows[track.index]
        self.completed += 1
        if self.world == 1:  # once a window, not on every report of a large cohort
            report = track.reports.get(0)
            if report is not None and report.batches:
                self.solo_ms = report.compute_ms / report.batches
        epoch = self.epochs[track.epoch]
        epoch.done += 1
        if epoch.all_planned and epoch.done == epoch.planned:
            epoch.end = now
        self.global_step += sum(track.batches)
        return epoch

    def settle(self, window: int, rank: int) -> bool:
        """``rank`` averaged ``window``, an epoch's last: True once its epoch is settled."""
        epoch = self.settle_windows.get(window)
        if epoch is None or epoch not in self.epochs:
            return False
        track = self.epochs[epoch]
        track.unsettled.discard(rank)
        return not track.unsettled  # O(1) until the last member's: only that one can close it

    def unsettle(self, window: int, ranks: set[int]) -> None:
        """``ranks`` will never settle ``window`` (they regrouped instead)."""
        epoch = self.settle_windows.get(window)
        if epoch is not None and epoch in self.epochs:
            self.epochs[epoch].unsettled -= ranks

    def lose(self, dead: int) -> tuple[int, WindowTrack | None]:
        """``dead`` is lost: its acknowledgements, pending eval and open work go back. Returns
        the first open window and, if that window is complete without it, the window."""
        first_open = self.completed_index()
        self._forget(dead, first_open)
        return first_open, self._void_windows(dead, first_open)

    def lose_after_stop(self, dead: int) -> None:
        """``dead`` is lost after Stop went out (every window reported, the last ones perhaps
        still being averaged): what an open epoch may still await from it, its
        acknowledgements and its eval shard, is given up, so that epoch closes instead of
        keeping the run from finishing. So are the survivors' acknowledgements: one whose
        average of the last window failed with ``dead`` gets no new membership (the run is
        stopping) and never acknowledges it; it stops with the weights it has."""
        for epoch in self.epochs.values():
            epoch.unsettled.clear()
        self._lose_eval(dead, self.completed_index())

    def _forget(self, dead: int, first_open: int) -> None:
        for epoch in self.epochs.values():
            epoch.unsettled.discard(dead)  # its acknowledgement will never come
        self._lose_eval(dead, first_open)

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

    def _void_windows(self, dead: int, first_open: int) -> WindowTrack | None:
        """The dead rank's work in open windows is lost. Later windows are void: what survivors
        already reported there (cpu_async runs ahead) stays trained, the rest is given back."""
        assert self.coverage is not None
        for index in sorted(self.windows):
            track = self.windows[index]
            if self.checkpointer is not None and (index != first_open or track.chunks[dead]):
                self.checkpointer.void(index)  # its epoch is not complete any more: re-planned
            for r in sorted(track.expected):
                if r == dead or (index != first_open and r not in track.reports):
                    self.give_back(track, r)
            if index == first_open:
                track.expected.discard(dead)
                track.batches[dead] = 0
            else:
                del self.windows[index]
                self.epochs[track.epoch].planned -= 1
                self.completed += 1
        first = self.windows.get(first_open)
        return first if first is not None and first.complete else None

    def give_back(self, track: WindowTrack, rank: int) -> None:
        """``rank``'s chunks of ``track`` go back to their epoch's cursor (its report, if any,
        leaves the totals)."""
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

    def unrecord(self, track: WindowTrack, rank: int) -> None:
        """``rank``'s work in ``track`` never reached the model: coverage forgets it."""
        assert self.coverage is not None
        self.coverage.unrecord(track.epoch, track.chunks[rank])

    def resume_point(self) -> tuple[int, list]:
        """The lowest unfinished epoch and its uncovered ranges (where a resumed run starts)."""
        for epoch in sorted(self.cursors):
            if not self.cursors[epoch].done:
                return epoch, list(self.cursors[epoch].ranges)
        return max(self.cursors, default=-1) + 1, []

    def take_eval(self, msg: EvalResult) -> bool:
        """One eval shard into its epoch; True once the epoch's eval is complete."""
        track = self.epochs.get(msg.epoch)
        return track is not None and track.take_eval(msg.rank, msg.window, msg.shard, msg.parts)
