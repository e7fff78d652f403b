"""Planning: which rank trains which chunks in each window, and when the next window goes out.

A mixin of :class:`flodl.runtime.controller.Controller`, split out so that each file holds one
question: this one decides *what* is dispatched; the controller decides *when* and handles events.
"""

from __future__ import annotations

import math

from flodl.config import Mode, TrainerConfig
from flodl.elche import ElChe, auto_max_overshoot, averaging_weights, buffer_weights
from flodl.runtime.dispatch import EpochCursor, chunk_batches, clamp_to_samples
from flodl.runtime.links import Outbound
from flodl.runtime.membership import Membership
from flodl.runtime.messages import CohortPlan, PlannedWindow
from flodl.runtime.snapshots import Checkpointer
from flodl.runtime.tracking import EpochTrack, WindowTrack

# A sync-mode plan bundles enough lock-step windows for about this much work, so the controller
# is not on every step's critical path.
_SYNC_PLAN_S = 0.25


def whole_steps(counts: list[int], cfg: TrainerConfig) -> list[int]:
    """Round each rank's micro-batches up to whole optimizer steps (accumulate_grad_batches), so
    a window rarely ends inside a group. ElChe's "batch" is a micro-batch: it times and counts
    those; the cursor clips what it hands out to what the epoch has left."""
    n = cfg.accumulate_grad_batches
    return [math.ceil(c / n) * n for c in counts]


class Planning(Outbound):
    """Window planning over the epoch cursors (needs the controller's state below)."""

    cfg: TrainerConfig
    world: int
    mode: Mode
    has_eval: bool
    lookahead: int
    members: Membership
    elche: ElChe | None
    checkpointer: Checkpointer | None
    cursors: dict[int, EpochCursor]
    epochs: dict[int, EpochTrack]
    windows: dict[int, WindowTrack]
    next_window: int
    completed: int
    all_planned: bool
    stop_reason: str | None
    shard_sizes: tuple[int, ...] = ()  # sharded data: samples per shard, from Ready
    regrouping: dict[int, bool]
    overshoot: tuple[int, int, int]
    batch_sizes: list[int]  # per rank, from their Ready messages
    _settle_windows: dict[int, int]

    @property
    def alive(self) -> list[int]:
        return self.members.members

    def _head(self) -> int:
        """The rank that sends the final state: the first survivor."""
        return self.alive[0] if self.alive else 0

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
        sizes, bounds = self.shard_sizes, []
        if sizes:  # sharded data: chunks end on shard boundaries (flodl.streams)
            from flodl.streams import shard_boundaries

            bounds = shard_boundaries(sizes, self.cfg.seed, epoch)
        self.cursors[epoch] = EpochCursor(
            epoch, n_samples, self.cfg.batch_size, list(ranges or []), bounds
        )
        self.epochs[epoch] = EpochTrack(epoch, self.world)

    def _fill(self) -> None:
        while (
            self.stop_reason is None
            and not self.regrouping
            and not self.all_planned
            and self.next_window - self.completed <= self.lookahead
            and not self._awaiting_verdict()
        ):
            self._plan_batch()

    def _awaiting_verdict(self) -> bool:
        """With early stopping, the next epoch waits until the previous one closed (its last
        window and its eval are in): the stop then lands exactly after the epoch that asked for
        it, at the cost of the ranks idling for that last window and the eval."""
        if self.cfg.early_stopping is None:
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
            self._send_shared(self.alive, plan, plan.for_rank)
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

    def _window_counts(self, cursor: EpochCursor, sizes: list[int]) -> list[int]:
        """ElChe's batch counts (each rank's batches are its own size), clamped to the epoch."""
        if len(set(sizes)) == 1:
            return whole_steps(self._counts(cursor.remaining_batches), self.cfg)
        # ElChe clamps in batches: bound it by the smallest size, then clamp in samples.
        bound = math.ceil(cursor.remaining_samples / min(sizes))
        counts = clamp_to_samples(self._counts(bound), sizes, cursor.remaining_samples)
        return whole_steps(counts, self.cfg)

    def _plan_window(self, cursor: EpochCursor) -> PlannedWindow:
        remaining = cursor.remaining_samples
        # The LR clock: derived from epoch and coverage only, so a resumed run lands on it too.
        progress = cursor.epoch * cursor.n_samples + cursor.n_samples - remaining
        sizes = self.batch_sizes
        chunks = cursor.take(self._window_counts(cursor, sizes), sizes)
        batches = [chunk_batches(c, size) for c, size in zip(chunks, sizes, strict=True)]
        samples = [sum(size for _, size in c) for c in chunks]
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
        settle = False
        if cursor.done:
            track.all_planned = True
            settle = self.world > 1 and self.mode is not Mode.SOLO and not self.mode.via_controller
            if settle:
                track.unsettled = set(self.alive)
                self._settle_windows[index] = cursor.epoch
            shards = self._eval_shards(cursor.epoch)
            track.plan_eval(index, set(shards))
            # save_best: every evaluated epoch is saved too, so the best one can be kept.
            best = bool(shards) and self.cfg.save_best is not None
            if self.checkpointer is not None and (
                self.checkpointer.due(cursor.epoch, self.cfg.num_epochs) or best
            ):
                save = self.checkpointer.open(
                    index, "checkpoint", cursor.epoch + 1, self.alive, writer=self._head()
                )
        # nccl_sync: DDP's gradient all-reduce when every member steps (else, at an epoch's
        # tail with fewer batches than ranks, the parameter average as in the other modes).
        grads = self.mode is Mode.NCCL_SYNC and len(self.alive) > 1
        grads = grads and all(batches[r] > 0 for r in self.alive)
        self.windows[index] = WindowTrack(
            index, cursor.epoch, batches, list(chunks), set(self.alive)
        )
        alive = self.alive
        return PlannedWindow(
            index,
            cursor.epoch,
            {r: chunks[r] for r in alive},
            {r: (weights[r], bweights[r]) for r in alive},
            eval_shards=shards,
            writer=save.writer if save is not None else -1,
            max_overshoot=self.overshoot[0],
            checkpoint_after=save is not None,
            generation=self.members.generation,
            save_tag=save.tag if save is not None else "",
            settle=settle,
            progress=progress,
            window_samples=remaining - cursor.remaining_samples,
            grad_sync=grads,
        )

    def _eval_shards(self, epoch: int) -> dict[int, tuple[int, int]]:
        """Which ranks evaluate after ``epoch``, each with its ``(shard, shards)``."""
        last = epoch == self.cfg.num_epochs - 1
        if not self.has_eval or not (last or (epoch + 1) % self.cfg.eval_every == 0):
            return {}
        if self.cfg.eval_policy == "sharded":
            members = self.alive
            return {r: (i, len(members)) for i, r in enumerate(members)}
        return {self._eval_rank(): (0, 1)}

    def _eval_rank(self) -> int:
        policy = self.cfg.callback_policy
        if policy.kind == "rank" and self.members.alive[policy.rank]:
            return policy.rank
        if self.elche is not None:
            return self.elche.fastest_rank(alive=self.members.alive)
        return self._head()
