"""Meta-controller: shrink the anchor when the optimisation regime changes under it.

The cadence auto-tune only sees cost (sync vs compute) and the guard only sees one cycle's
divergence trend. Two slower signals say a long window has become risky: a learning-rate cliff
(a step schedule just cut the LR, the loss landscape is being re-entered at a finer scale) and a
streak of bad guard verdicts (the guard keeps objecting but growth vetoes alone are not enough).
Both answer with a multiplicative cut of the anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flodl.elche.guard import Verdict
from flodl.elche.state import VERDICT_HISTORY, Phase

#: An LR drop larger than this fraction within one cycle is a cliff.
LR_CLIFF_DROP = 0.30
#: Anchor factor on an LR cliff.
LR_CLIFF_FACTOR = 0.5
#: Bad verdicts in a row that fire the streak rule; shorter as the cadence matures, because a
#: mature cadence has long windows and each bad cycle costs more.
STREAK_LENGTH = {Phase.WARMUP: 5, Phase.STABLE: 3, Phase.MATURE: 2}
#: Anchor factor of the streak rule per phase; early streaks cut harder (less is known yet).
STREAK_FACTOR = {Phase.WARMUP: 0.3, Phase.STABLE: 0.5, Phase.MATURE: 0.7}
#: Bounds of the applied factor: never wipe the cadence out, never a no-op cut.
FACTOR_MIN, FACTOR_MAX = 0.1, 0.95

_BAD = (Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN)


class MetaController:
    """Watches LR and guard verdicts across cycles; proposes an anchor factor when one fires."""

    def __init__(
        self,
        enabled: bool,
        verdicts: Sequence[Verdict] = (),
        last_lr: float | None = None,
    ) -> None:
        self.enabled = enabled
        self._verdicts = list(verdicts)[-VERDICT_HISTORY:]
        self._last_lr = last_lr

    @property
    def verdicts(self) -> list[Verdict]:
        """A copy of the remembered verdicts, oldest first."""
        return list(self._verdicts)

    @property
    def last_lr(self) -> float | None:
        """The last learning rate reported (the reference for the cliff rule)."""
        return self._last_lr

    def observe(self, phase: Phase, verdict: Verdict, lr: float | None) -> float | None:
        """Record one cycle; return the anchor factor to apply, or None when nothing fires.

        ``phase`` is the phase the cycle ran in; the controller stays silent in PROBE, where
        neither speeds nor verdicts mean much yet, but it keeps recording.
        """
        self._verdicts.append(verdict)
        del self._verdicts[:-VERDICT_HISTORY]
        cliff = self._lr_cliff(lr)
        if not self.enabled or phase is Phase.PROBE:
            return None
        factor = 1.0
        if cliff:
            factor *= LR_CLIFF_FACTOR
        if self._bad_streak(phase):
            factor *= STREAK_FACTOR[phase]
            # Start counting afresh, or every further bad cycle would cut again at once.
            self._verdicts.clear()
        if factor == 1.0:
            return None
        return min(max(factor, FACTOR_MIN), FACTOR_MAX)

    def _lr_cliff(self, lr: float | None) -> bool:
        if lr is None:
            return False
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"lr={lr}: must be a finite number >= 0")
        previous, self._last_lr = self._last_lr, float(lr)
        return previous is not None and previous > 0 and lr < (1.0 - LR_CLIFF_DROP) * previous

    def _bad_streak(self, phase: Phase) -> bool:
        need = STREAK_LENGTH[phase]
        recent = self._verdicts[-need:]
        return len(recent) == need and all(v in _BAD for v in recent)
