"""Convergence guards: the final say on whether the anchor may grow.

After every averaging cycle the runtime measures the weight-space divergence
``||W_before - W_after|| / ||W_after||`` (max over ranks). A guard reads that series and returns a
:class:`Verdict`: ``STABLE`` lets the cadence proposal through, ``SUPPRESS_GROWTH`` vetoes growth
and ``NUDGE_DOWN`` shrinks the anchor. Every guard shares one interface (:class:`ConvergenceGuard`)
and one serialisable memory (:class:`GuardMemory`), so ElChe can swap them by config and resume
them from a checkpoint.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum

from flodl.config import ElCheConfig, Guard

#: Divergences kept per guard (the trend rule looks at the last three; five gives context).
HISTORY_LEN = 5


class Verdict(str, Enum):
    """What a guard decided about the anchor proposal of one cycle."""

    STABLE = "stable"
    SUPPRESS_GROWTH = "suppress_growth"
    NUDGE_DOWN = "nudge_down"


@dataclass(frozen=True)
class GuardDecision:
    """A verdict plus, for ``NUDGE_DOWN``, the factor the anchor is multiplied by."""

    verdict: Verdict
    nudge_factor: float = 1.0


STABLE = GuardDecision(Verdict.STABLE)


@dataclass
class GuardMemory:
    """Everything a guard remembers between cycles (the part of ElCheState a guard owns).

    ``history`` is the divergence ring every guard keeps; the ``msf_*`` fields are only used by
    :class:`MsfGuard` (raw EMA accumulator, number of EMA events, and the runs of consecutive
    events above its suppress / nudge thresholds).
    """

    history: list[float] = field(default_factory=list)
    msf_ema: float = 0.0
    msf_events: int = 0
    msf_suppress_run: int = 0
    msf_nudge_run: int = 0


class ConvergenceGuard(ABC):
    """Common interface: feed one divergence per cycle, get one decision back."""

    def __init__(self, memory: GuardMemory | None = None) -> None:
        self._memory = memory if memory is not None else GuardMemory()

    @property
    def memory(self) -> GuardMemory:
        """The guard's live memory (ElChe copies it into its state)."""
        return self._memory

    def observe(self, divergence: float) -> GuardDecision:
        """Record ``divergence`` (finite, >= 0) and judge the cycle it closes."""
        if not math.isfinite(divergence) or divergence < 0:
            raise ValueError(f"divergence={divergence}: must be a finite number >= 0")
        history = self._memory.history
        previous = history[-1] if history else None
        history.append(float(divergence))
        del history[:-HISTORY_LEN]
        return self._judge(previous, float(divergence))

    @abstractmethod
    def _judge(self, previous: float | None, current: float) -> GuardDecision:
        """Decide once ``current`` is in the history; ``previous`` is the value before it."""


class NoGuard(ConvergenceGuard):
    """Never objects (``guard=none``); still records the history for telemetry."""

    def _judge(self, previous: float | None, current: float) -> GuardDecision:
        return STABLE


class TrendGuard(ConvergenceGuard):
    """Veto growth when divergence rose three times in a row and ends above ``threshold``.

    Three strict rises filter single noisy cycles; the threshold keeps a rising but tiny
    divergence (early training settles from 1e-4 to 1e-3) from freezing the cadence. It never
    nudges down: a trend is evidence against growing, not proof that the window is too long.
    """

    def __init__(self, threshold: float, memory: GuardMemory | None = None) -> None:
        super().__init__(memory)
        if not threshold > 0:
            raise ValueError(f"threshold={threshold}: must be > 0")
        self.threshold = threshold

    def _judge(self, previous: float | None, current: float) -> GuardDecision:
        last3 = self._memory.history[-3:]
        rising = len(last3) == 3 and last3[0] < last3[1] < last3[2]
        if rising and current > self.threshold:
            return GuardDecision(Verdict.SUPPRESS_GROWTH)
        return STABLE


class MsfGuard(ConvergenceGuard):
    """Master-stability-function style guard: watch the growth *rate* of divergence.

    ``lambda = ln(D_t / D_{t-1})`` is smoothed by a bias-corrected EMA (alpha 0.9). A positive
    rate sustained for three events means averaging no longer pulls replicas together: above
    ``suppress_rate`` growth is vetoed, above ``nudge_rate`` the anchor is also cut by
    ``nudge_factor``. Divergences under ``noise_floor`` make the log ratio meaningless, so they
    reset the estimate instead of feeding it.
    """

    alpha = 0.9
    noise_floor = 1e-8
    suppress_rate = 1e-3
    nudge_rate = 1e-2
    events_needed = 3
    nudge_factor = 0.5

    def _judge(self, previous: float | None, current: float) -> GuardDecision:
        mem = self._memory
        if previous is None:
            return STABLE
        if previous < self.noise_floor or current < self.noise_floor:
            mem.msf_ema, mem.msf_events, mem.msf_suppress_run, mem.msf_nudge_run = 0.0, 0, 0, 0
            return STABLE
        rate = math.log(current / previous)
        mem.msf_ema = self.alpha * mem.msf_ema + (1.0 - self.alpha) * rate
        mem.msf_events += 1
        smoothed = mem.msf_ema / (1.0 - self.alpha**mem.msf_events)
        mem.msf_suppress_run = mem.msf_suppress_run + 1 if smoothed > self.suppress_rate else 0
        mem.msf_nudge_run = mem.msf_nudge_run + 1 if smoothed > self.nudge_rate else 0
        if mem.msf_nudge_run >= self.events_needed:
            # Demand a fresh run of evidence before the next cut, or a persistent rate would
            # halve the anchor every single cycle.
            mem.msf_nudge_run = 0
            return GuardDecision(Verdict.NUDGE_DOWN, self.nudge_factor)
        if mem.msf_suppress_run >= self.events_needed:
            return GuardDecision(Verdict.SUPPRESS_GROWTH)
        return STABLE


def make_guard(config: ElCheConfig, memory: GuardMemory | None = None) -> ConvergenceGuard:
    """The guard ``config.guard`` names, resuming from ``memory`` when given."""
    if config.guard is Guard.TREND:
        return TrendGuard(config.effective_divergence_threshold, memory)
    if config.guard is Guard.MSF:
        return MsfGuard(memory)
    return NoGuard(memory)
