"""Test-only fault injection: kill or freeze a chosen process at a named moment of a run.

``FLODL_CHAOS`` holds comma-separated faults ``VICTIM:MOMENT[:NTH[:ACTION]]``:

* ``VICTIM`` — a global rank number, or ``launcher``;
* ``MOMENT`` — one of :data:`RANK_MOMENTS` (in a rank) or :data:`LAUNCHER_MOMENTS` (in the
  launcher's controller);
* ``NTH`` — strike at the NTH time the moment is reached (default 1);
* ``ACTION`` — ``kill`` (SIGKILL, default), ``stop`` (SIGSTOP: alive but silent) or ``raise``
  (a ``RuntimeError`` from that point, as a user's code would); ``kill@SECONDS`` kills that
  long after the moment, whatever the process is doing then (``1:join:1:kill@0.05``: inside
  the group's formation, between the named moments).

Unset — as in every real run — each :func:`point` is one environment lookup. The chaos matrix
(``bench/chaos/matrix.py``) and its in-suite part (``tests/integration/test_chaos.py``) use it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass

from flodl.runtime.wire import rank_env

RANK_MOMENTS = (
    "hello",  # the process just started: before it reaches the controller
    "join",  # the job received, before the process group is formed
    "form",  # every member present at the group's barrier, before gloo/NCCL connect
    "start",  # model and data built, before Ready
    "calibrate",  # during the warm-up timing, every rank in it together
    "window",  # after the first batch of a window
    "report",  # the window reported, averaging not yet begun
    "average",  # averaging begun (collective entered / snapshot sent)
    "eval",  # this rank was elected and its eval is pending
    "checkpoint",  # a checkpoint is due and this rank's state not yet sent
    "regroup",  # a Regroup arrived and the new group is being formed
    "final_save",  # Stop arrived; this rank owes the weights shard of the save at Stop
    "final",  # Stop arrived; this rank owes the final weights and has not sent them yet
)
LAUNCHER_MOMENTS = (
    "checkpoint_write",  # every state collected, the bundle not yet written
    "stop",  # the graceful stop began
)


@dataclass(frozen=True)
class Fault:
    victim: str  # a rank number as text, or "launcher"
    moment: str
    nth: int = 1
    action: str = "kill"
    delay_s: float = 0.0  # kill@SECONDS


def parse(spec: str) -> list[Fault]:
    """Faults from a ``FLODL_CHAOS`` value; a malformed one is a ``ValueError`` naming it."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fields = item.split(":")
        if not 2 <= len(fields) <= 4:
            raise ValueError(f"FLODL_CHAOS={spec!r}: {item!r} is not VICTIM:MOMENT[:NTH[:ACTION]]")
        victim, moment = fields[0], fields[1]
        nth = int(fields[2]) if len(fields) > 2 and fields[2] else 1
        action = fields[3] if len(fields) > 3 else "kill"
        action, _, delay = action.partition("@")
        delay_s = _seconds(delay) if action == "kill" else (-1.0 if delay else 0.0)
        moments = LAUNCHER_MOMENTS if victim == "launcher" else RANK_MOMENTS
        bad = action not in ("kill", "stop", "raise") or nth < 1 or delay_s < 0
        if moment not in moments or bad:
            raise ValueError(f"FLODL_CHAOS={spec!r}: bad fault {item!r}; moments: {moments}")
        if victim != "launcher" and not victim.isdigit():
            raise ValueError(f"FLODL_CHAOS={spec!r}: victim {victim!r} is not a rank or 'launcher'")
        faults.append(Fault(victim, moment, nth, action, delay_s))
    return faults


def _seconds(text: str) -> float:
    try:
        value = float(text) if text else 0.0
    except ValueError:
        return -1.0
    return value if value >= 0 else -1.0


class _Chaos:
    def __init__(self, spec: str) -> None:
        self.faults = parse(spec)
        self.seen: Counter[str] = Counter()

    def point(self, victim: str, moment: str) -> None:
        self.seen[moment] += 1
        for fault in self.faults:
            if fault.victim == victim and fault.moment == moment and fault.nth == self.seen[moment]:
                _strike(fault)


def _strike(fault: Fault) -> None:
    if fault.delay_s > 0:
        kill = threading.Timer(fault.delay_s, os.kill, (os.getpid(), signal.SIGKILL))
        kill.daemon = True
        kill.start()
        return
    if fault.action == "raise":
        raise RuntimeError(f"chaos: injected failure at {fault.moment}")
    os.kill(os.getpid(), signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP)


_active: dict[str, _Chaos] = {}  # by spec: a test process may run several faulted jobs


def point(moment: str, rank: int | None = None) -> None:
    """A named moment of this process: strike when a fault of ``FLODL_CHAOS`` names it.
    ``rank`` is the caller's global rank; ``None`` means the launcher."""
    spec = rank_env.chaos_spec()
    if not spec:
        return
    if spec not in _active:
        _active.clear()
        _active[spec] = _Chaos(spec)
    _active[spec].point("launcher" if rank is None else str(rank), moment)


__all__ = ["LAUNCHER_MOMENTS", "RANK_MOMENTS", "Fault", "parse", "point"]
