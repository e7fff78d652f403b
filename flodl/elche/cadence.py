"""ElChe, the heterogeneous cadence balancer: "the column marches at the slowest one's pace".

The slow rank (the *anchor rank*) does ``anchor`` batches per averaging window; every other rank
does proportionally more, so all of them finish the window at about the same wall time. The
anchor auto-tunes so that sync costs about ``overhead_target`` of compute, a convergence guard
may veto growth, and a meta-controller cuts the anchor when the regime changes
(docs/design/elche.md).

This module is pure: it sees numbers (fake timings in tests, real ones in the runtime) and
returns numbers. No clocks, no I/O, no randomness, so a resumed controller fed the same reports
makes the same decisions.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from flodl.config import ElCheConfig
from flodl.elche.guard import STABLE, GuardDecision, GuardMemory, Verdict, make_guard
from flodl.elche.meta import MetaController
from flodl.elche.speed import (
    MAX_SPEED_RATIO,
    SpeedTracker,
    apply_dead_zone,
    bound_spread,
    clamp_window,
    elect_anchor_rank,
    relative_counts,
    speed_counts,
    speed_order,
)
from flodl.elche.state import SHARE_WINDOW, Cycle, ElCheState, Phase, phase_for

#: The anchor at most doubles per cycle, however high the overhead.
MAX_GROWTH = 2.0
#: Consecutive Stable verdicts that re-arm growth after the guard latched it off.
REARM_AFTER = 5
#: Bounds of a guard's NudgeDown factor.
NUDGE_MIN, NUDGE_MAX = 0.1, 1.0


# --- anchor proposal ------------------------------------------------------------------------------


def propose_anchor(
    anchor: int, overhead: float, target: float, phase: Phase, lo: int, hi: int
) -> int:
    """The cadence proposal from one cycle's overhead (``phase`` = the phase it ran in).

    Above ``target``: grow to ``ceil(anchor * min(overhead / target, 2))``, at most ``hi``, from
    WARMUP on (in WARMUP only above ``2 * target``: early timings are inflated by warm-up work).
    Below ``target / 2``: shrink by one, never under ``lo``. An anchor already under ``lo``
    (after a nudge) is not lifted by the clamp: only a real growth proposal raises it.
    """
    can_grow = phase.level >= Phase.STABLE.level or (
        phase is Phase.WARMUP and overhead > 2 * target
    )
    if overhead > target and can_grow:
        grown = math.ceil(anchor * min(overhead / target, MAX_GROWTH))
        return max(anchor, min(grown, hi))
    if overhead < target / 2 and anchor - 1 >= lo:
        return anchor - 1
    return anchor


# --- the controller ----------------------------------------------------------------------------


class ElChe:
    """Decides, after every averaging cycle, how many batches each rank does in the next window.

    ``speed_hint`` (relative speeds, e.g. ``[1.0, 0.4]``) only shapes the counts (and the
    fastest-rank order) before the first calibration; without it every rank starts at ``anchor``.
    Pass ``state`` (from :meth:`state`) to resume a controller exactly where it stopped.
    """

    def __init__(
        self,
        config: ElCheConfig,
        world_size: int,
        *,
        state: ElCheState | None = None,
        speed_hint: Sequence[float] | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size}: must be an integer >= 1")
        self._config = config
        self._world = world_size
        self._sync = config.mode.policy.lock_step
        self._lo, self._hi = config.effective_min_anchor, config.max_anchor
        self._hint = _check_hint(speed_hint, world_size)
        self._ratios = config.partition_ratios
        if self._ratios is not None and len(self._ratios) != world_size:
            raise ValueError(
                f"elche.partition_ratios={self._ratios}: has {len(self._ratios)} entries "
                f"but world_size={world_size}; give one ratio per rank"
            )
        if state is None:
            self._fresh()
        else:
            self._resume(state)

    def _fresh(self) -> None:
        self._anchor = self._config.anchor
        self._anchor_rank: int | None = None
        self._calibrations = 0
        self._phase = Phase.PROBE
        self._speed = SpeedTracker(self._world)
        self._guard = make_guard(self._config)
        self._latched = False
        self._clean = 0
        self._meta = MetaController(self._config.meta_controller and not self._sync)
        self._counts = bound_spread(self._raw_counts(self._anchor), self._config.max_batch_diff)
        self._history: list[list[int]] = []

    def _resume(self, state: ElCheState) -> None:
        state.validate(self._world)
        # User knobs are not saved: a config with a lower max_anchor wins over the saved anchor.
        self._anchor = min(state.anchor, self._hi)
        self._anchor_rank = state.anchor_rank
        self._calibrations = state.calibration_count
        self._phase = state.phase
        self._speed = SpeedTracker(self._world, state.speed_windows, state.zero_streaks)
        memory = GuardMemory(
            list(state.trend_history),
            state.msf_ema,
            state.msf_events,
            state.msf_suppress_run,
            state.msf_nudge_run,
        )
        self._guard = make_guard(self._config, memory)
        self._latched = state.growth_latched_off
        self._clean = state.clean_verdicts
        enabled = self._config.meta_controller and not self._sync
        self._meta = MetaController(enabled, state.verdict_history, state.last_lr)
        self._counts = list(state.counts)
        if self._sync or self._ratios is not None:
            self._counts = self._raw_counts(self._anchor)
        self._counts = bound_spread(self._counts, self._config.max_batch_diff)
        self._history = [list(row) for row in state.counts_history][-SHARE_WINDOW:]

    # --- read-only views -----------------------------------------------------------------------

    @property
    def counts(self) -> list[int]:
        """Batches per rank for the next window, before the epoch clamp of :meth:`window`."""
        return list(self._counts)

    @property
    def anchor(self) -> int:
        """Batches the anchor (slow) rank does per window."""
        return self._anchor

    @property
    def anchor_rank(self) -> int | None:
        """The elected slow rank (None before the first calibration)."""
        return self._anchor_rank

    @property
    def phase(self) -> Phase:
        """Current phase (advances at 1 / 5 / 20 calibrations)."""
        return self._phase

    @property
    def calibrated(self) -> bool:
        """True once at least one report carried timing."""
        return self._calibrations > 0

    @property
    def smoothed_ms(self) -> list[float | None]:
        """Trust-window mean ms/batch per rank (None while unmeasured)."""
        return self._speed.smoothed()

    # --- one averaging cycle -------------------------------------------------------------------

    def report(
        self,
        compute_ms: Sequence[float],
        batches: Sequence[int],
        sync_ms: float,
        divergence: float | None = None,
        lr: float | None = None,
    ) -> Cycle:
        """Feed one averaging cycle and decide the next window.

        ``compute_ms``/``batches``: per-rank compute wall ms and batches actually done since the
        last average; ``sync_ms``: the averaging wall ms; ``divergence``: max-over-ranks
        ``||W_before - W_after|| / ||W_after||`` (None if unknown: the guard is not consulted);
        ``lr``: the current learning rate (LR-cliff detection). Bad input raises ValueError and
        leaves the controller unchanged.
        """
        compute, done = self._check_report(compute_ms, batches, sync_ms, divergence, lr)
        ran_in = self._phase  # growth, election and meta rules follow the phase the cycle ran in
        first_calibration = self._calibrations == 0
        prev_anchor, prev_rank = self._anchor, self._anchor_rank
        timed = self._speed.update(compute, done)
        if timed:
            self._calibrations += 1
            self._phase = phase_for(self._calibrations)
        self._elect(ran_in)
        slowest = max(compute)
        overhead = sync_ms / slowest if slowest > 0 else 0.0
        proposed = self._anchor
        if timed and slowest > 0 and not self._sync:
            target = self._config.overhead_target
            proposed = propose_anchor(self._anchor, overhead, target, ran_in, self._lo, self._hi)
        decision = self._judge(divergence)
        self._commit(proposed, decision, ran_in)
        meta_factor = self._meta.observe(ran_in, decision.verdict, lr)
        if meta_factor is not None:
            self._anchor = max(1, math.ceil(self._anchor * meta_factor))
        self._update_counts(first_calibration and timed, prev_anchor, prev_rank)
        return Cycle(
            anchor=self._anchor,
            counts=list(self._counts),
            overhead=overhead,
            verdict=decision.verdict,
            phase=self._phase,
            proposed_anchor=proposed,
            divergence=divergence,
            anchor_rank=self._anchor_rank,
            meta_factor=meta_factor,
        )

    def _check_report(
        self,
        compute_ms: Sequence[float],
        batches: Sequence[int],
        sync_ms: float,
        divergence: float | None,
        lr: float | None,
    ) -> tuple[list[float], list[int]]:
        if len(compute_ms) != self._world or len(batches) != self._world:
            raise ValueError(
                f"report: compute_ms has {len(compute_ms)} and batches {len(batches)} entries; "
                f"both need world_size={self._world}"
            )
        # Validated in C-level passes first (one entry a rank: 128 at 128 ranks); a NaN or an
        # infinity makes the sum non-finite (so can huge finite entries: then each is looked at).
        compute = list(map(float, compute_ms))
        suspect = compute and (not math.isfinite(sum(compute)) or min(compute) < 0)
        if suspect and any(not math.isfinite(ms) or ms < 0 for ms in compute):
            raise ValueError(f"report: compute_ms={compute}: every entry must be finite and >= 0")
        try:
            done = list(map(operator.index, batches))
        except TypeError:
            raise ValueError(f"report: batches={list(batches)}: entries must be integers") from None
        if done and min(done) < 0:
            raise ValueError(f"report: batches={done}: entries must be >= 0")
        for name, value in (("sync_ms", sync_ms), ("divergence", divergence), ("lr", lr)):
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"report: {name}={value}: must be a finite number >= 0")
        return compute, done

    def _elect(self, ran_in: Phase) -> None:
        rank = self._anchor_rank
        smoothed = self._speed.means()
        unusable = rank is None or smoothed[rank] is None
        # Before STABLE the speeds are too young to move a standing anchor; a missing or
        # silent anchor rank is replaced at any phase, or the cadence would have no reference.
        if unusable or ran_in.level >= Phase.STABLE.level:
            self._anchor_rank = elect_anchor_rank(smoothed, rank)

    def _judge(self, divergence: float | None) -> GuardDecision:
        # Sync modes have no window to protect (one step per average), so they are always Stable.
        if divergence is None or self._sync:
            return STABLE
        return self._guard.observe(divergence)

    def _commit(self, proposed: int, decision: GuardDecision, ran_in: Phase) -> None:
        verdict = decision.verdict
        if verdict is Verdict.STABLE:
            self._clean += 1
            if self._latched and self._clean >= REARM_AFTER:
                self._latched = False
        else:
            self._clean = 0
            self._latched = True
        if self._sync:
            return
        if verdict is Verdict.NUDGE_DOWN:
            factor = min(max(decision.nudge_factor, NUDGE_MIN), NUDGE_MAX)
            self._anchor = max(1, math.ceil(self._anchor * factor))
            return
        if proposed > self._anchor and self._latched:
            proposed = self._anchor  # growth vetoed; a shrink still goes through
        relax = (
            self._config.relax_up
            and not self._latched
            and ran_in.level >= Phase.STABLE.level
            and proposed >= self._anchor
            and proposed < self._hi
            and self._spread_fits(proposed + 1)
        )
        self._anchor = proposed + 1 if relax else proposed

    def _spread_fits(self, anchor: int) -> bool:
        """Whether ``anchor`` keeps the raw counts within max_batch_diff (relax_up respects it)."""
        bound = self._config.max_batch_diff
        if bound is None:
            return True
        raw = self._raw_counts(anchor)
        return max(raw) - min(raw) <= bound

    def _raw_counts(self, anchor: int) -> list[int]:
        """Counts for ``anchor`` before the dead zone and the spread bound."""
        if self._sync:
            return [anchor] * self._world
        if self._ratios is not None:
            return relative_counts(anchor, self._ratios, cap=None)
        rank = self._anchor_rank
        if rank is None or self._speed.means()[rank] is None:
            if self._hint is not None:
                return relative_counts(anchor, self._hint, cap=MAX_SPEED_RATIO)
            return [anchor] * self._world
        return speed_counts(anchor, self._speed.means(), rank, self._counts)

    def _update_counts(
        self, first_calibration: bool, prev_anchor: int, prev_rank: int | None
    ) -> None:
        target = self._raw_counts(self._anchor)
        # The dead zone filters speed jitter only; a new anchor or anchor rank is a decision
        # and must reach every rank, however small the change.
        if not first_calibration and self._anchor == prev_anchor and self._anchor_rank == prev_rank:
            target = apply_dead_zone(target, self._counts)
        self._counts = bound_spread(target, self._config.max_batch_diff)
        self._history.append(list(self._counts))
        del self._history[:-SHARE_WINDOW]

    # --- queries for the dispatcher ------------------------------------------------------------

    def window(self, remaining_batches: int, alive: Sequence[bool] | None = None) -> list[int]:
        """Counts for the next window clamped to ``remaining_batches`` (a window never exceeds
        the epoch): proportional scale-down keeping each alive rank >= 1 while there are enough
        batches, the fastest ranks first otherwise; dead ranks get 0."""
        if remaining_batches < 0:
            raise ValueError(f"remaining_batches={remaining_batches}: must be >= 0")
        order = speed_order(self._speed.means(), self._check_alive(alive), self._hint)
        return clamp_window(self._counts, remaining_batches, order)

    def fastest_rank(self, alive: Sequence[bool] | None = None) -> int:
        """The alive rank with the lowest smoothed ms/batch (ties: lowest index); before
        calibration the highest speed hint, else the lowest alive index."""
        order = speed_order(self._speed.smoothed(), self._check_alive(alive), self._hint)
        if not order:
            raise ValueError("fastest_rank: no rank is alive")
        return order[0]

    def batch_share(self) -> list[float]:
        """Each rank's share of the work: mean of the last 10 counts snapshots, summing to 1."""
        rows = self._history or [self._counts]
        per_rank = [sum(row[r] for row in rows) for r in range(self._world)]
        total = sum(per_rank)
        return [c / total for c in per_rank]

    def state(self) -> ElCheState:
        """A detached snapshot of everything needed to resume (see :class:`ElCheState`)."""
        memory = self._guard.memory
        return ElCheState(
            anchor=self._anchor,
            anchor_rank=self._anchor_rank,
            smoothed_ms_per_batch=self._speed.smoothed(),
            phase=self._phase,
            calibration_count=self._calibrations,
            trend_history=list(memory.history),
            counts=list(self._counts),
            growth_latched_off=self._latched,
            clean_verdicts=self._clean,
            speed_windows=self._speed.windows(),
            zero_streaks=self._speed.zero_streaks(),
            msf_ema=memory.msf_ema,
            msf_events=memory.msf_events,
            msf_suppress_run=memory.msf_suppress_run,
            msf_nudge_run=memory.msf_nudge_run,
            verdict_history=self._meta.verdicts,
            last_lr=self._meta.last_lr,
            counts_history=[list(row) for row in self._history],
        )

    def _check_alive(self, alive: Sequence[bool] | None) -> list[bool]:
        if alive is None:
            return [True] * self._world
        if len(alive) != self._world:
            raise ValueError(f"alive has {len(alive)} entries but world_size={self._world}")
        return list(map(bool, alive))


def _check_hint(speed_hint: Sequence[float] | None, world_size: int) -> list[float] | None:
    if speed_hint is None:
        return None
    hint = [float(s) for s in speed_hint]
    if len(hint) != world_size or any(not math.isfinite(s) or s <= 0 for s in hint):
        raise ValueError(
            f"speed_hint={hint}: needs {world_size} finite relative speeds > 0 (one per rank)"
        )
    return hint
