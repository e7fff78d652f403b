"""The controller's events: what the launcher posts into its inbox besides the ranks' own
messages (:class:`Exited`, :class:`Disconnected`), and the :class:`Hooks` it calls out through
(progress, sync events, closed epochs, killing a silent rank)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flodl.metrics import EpochMetrics, SyncEvent


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
