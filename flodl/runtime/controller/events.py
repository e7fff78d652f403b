"""The controller's events: what the launcher posts into its inbox besides the ranks' own
messages (:class:`Exited`, :class:`Disconnected`), the :class:`Hooks` it calls out through
(progress, sync events, closed epochs, killing a silent rank), and :class:`RunFailed`, how it
ends a run that cannot go on."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from flodl.monitor.metrics import EpochMetrics, SyncEvent


class RunFailed(RuntimeError):
    """A rank failed; the message is the rank's own, reported once."""


@dataclass(frozen=True)
class Exited:
    """Posted by the supervisor when a rank process ends."""

    code: int
    tail: str = ""

    def describe(self) -> str:
        """How the process ended, as a lost-rank message says it: ``exited with code 1``,
        ``killed by SIGKILL — out of memory?`` (the kernel's OOM killer sends SIGKILL; so
        does ``kill -9``), ``killed by SIGSEGV``. A negative code is the signal (subprocess's
        and ``os.waitstatus_to_exitcode``'s convention); 128+N is a shell's or ssh's."""
        number = -self.code if self.code < 0 else self.code - 128 if 128 < self.code < 160 else 0
        if not number:
            return f"exited with code {self.code}"
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        hint = " — out of memory?" if number == signal.SIGKILL else ""
        via = "" if self.code < 0 else f" (exit code {self.code})"
        return f"killed by {name}{hint}{via}"


@dataclass(frozen=True)
class Disconnected:
    """Posted by a rank's reader when its control channel is lost."""

    reason: str


@dataclass
class Hooks:
    """What the launcher's side hears of the run (each a no-op unless set)."""

    on_sync: Callable[[SyncEvent], None] = lambda ev: None
    # A closed epoch; a returned string is a stop request (its reason).
    on_epoch: Callable[[EpochMetrics], str | None] = lambda m: None
    on_steps: Callable[[int, tuple], None] = lambda rank, steps: None
    on_progress: Callable[[int, int, int, float | None, list[float]], None] = (
        lambda epoch, done, total, loss, shares: None
    )
    kill_rank: Callable[[int], None] = lambda rank: None
