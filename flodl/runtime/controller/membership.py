"""Elastic membership: who is alive, when a rank counts as lost, and when losses mean stop.

A rank is lost when its process exits (or fails) after the cohort formed, or when nothing has
been heard from it for ``cluster.heartbeat_timeout_s``. Survivors rebuild the process group under
a new generation and go on; ``trainer.max_failure`` (a count, or a percentage of the cohort)
turns losses into save-and-stop. Before the cohort forms, any failure fails the job fast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def failure_budget(max_failure: int | str | None, world_size: int) -> int | None:
    """How many ranks may be lost before save-and-stop (None: any partial loss)."""
    if max_failure is None:
        return None
    if isinstance(max_failure, str):
        percent = float(max_failure.rstrip("%"))
        return math.ceil(percent / 100.0 * world_size)
    return int(max_failure)


@dataclass
class Membership:
    """The alive mask of the cohort, its generation, and its heartbeat clock."""

    world_size: int
    budget: int | None = None
    heartbeat_timeout_s: float = 30.0
    alive: list[bool] = field(default_factory=list)
    generation: int = 0
    lost: list[int] = field(default_factory=list)
    last_seen: dict[int, float] = field(default_factory=dict)

    _members: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.alive = [True] * self.world_size
        self._members = list(range(self.world_size))

    @property
    def members(self) -> list[int]:
        """The alive ranks, ascending. Kept, not rebuilt (the controller asks on every
        message): a shared list that :meth:`lose` replaces, never edits; do not mutate it."""
        return self._members

    def seen(self, rank: int, now: float | None = None) -> None:
        self.last_seen[rank] = time.monotonic() if now is None else now

    def excuse(self, seconds: float) -> None:
        """The judge itself was not running for ``seconds`` (the launcher was paused, or its
        thread blocked): that time is nobody's silence, so every clock moves forward by it."""
        for rank in self.last_seen:
            self.last_seen[rank] += seconds

    def stale(self, now: float | None = None) -> list[int]:
        """Alive ranks silent for longer than the heartbeat timeout."""
        now = time.monotonic() if now is None else now
        return [
            r
            for r in self.members
            if r in self.last_seen and now - self.last_seen[r] > self.heartbeat_timeout_s
        ]

    def lose(self, rank: int) -> bool:
        """Mark ``rank`` lost; True if this is news (it was alive)."""
        if not self.alive[rank]:
            return False
        self.alive[rank] = False
        self._members = [r for r, ok in enumerate(self.alive) if ok]
        self.lost.append(rank)
        self.generation += 1
        return True

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and len(self.lost) > self.budget

    def group_rank(self, rank: int) -> int:
        """This rank's index in the current process group (dense over the survivors)."""
        return self.members.index(rank)
