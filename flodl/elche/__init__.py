"""ElChe: heterogeneity-aware cadence for parameter averaging (pure, deterministic).

The runtime feeds :meth:`ElChe.report` after every averaging cycle and asks :meth:`ElChe.window`
how many batches each rank does next. Nothing here touches torch, the network, files or clocks,
so the whole algorithm is tested on fake timings.
"""

from flodl.elche.cadence import ElChe
from flodl.elche.guard import (
    ConvergenceGuard,
    GuardDecision,
    GuardMemory,
    MsfGuard,
    NoGuard,
    TrendGuard,
    Verdict,
    make_guard,
)
from flodl.elche.meta import MetaController
from flodl.elche.state import Cycle, ElCheState, Phase, phase_for
from flodl.elche.weights import (
    MAX_OVERSHOOT_CEILING,
    auto_max_overshoot,
    averaging_weights,
    buffer_weights,
    step_max_overshoot,
)

__all__ = [
    "MAX_OVERSHOOT_CEILING",
    "ConvergenceGuard",
    "Cycle",
    "ElChe",
    "ElCheState",
    "GuardDecision",
    "GuardMemory",
    "MetaController",
    "MsfGuard",
    "NoGuard",
    "Phase",
    "TrendGuard",
    "Verdict",
    "auto_max_overshoot",
    "averaging_weights",
    "buffer_weights",
    "make_guard",
    "phase_for",
    "step_max_overshoot",
]
