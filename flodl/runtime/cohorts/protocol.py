"""How ranks come into being: one :class:`Cohort` protocol (start, join, lose a rank, stop,
outputs) that every launch path implements; :func:`flodl.runtime.cohorts.factory.open_cohort` picks
one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from flodl.runtime.controller.controller import ControllerResult


class Cohort(Protocol):
    """The ranks of one run, from their start to their teardown."""

    def start(self) -> None:
        """Bring every rank up (spawn, submit, or publish where the controller is)."""

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        """Run the controller until the run ends; ``stop_requested`` asks for a graceful stop."""

    def lose(self, rank: int) -> None:
        """Take one (silent) rank down so that its loss is certain."""

    def stop(self, failure: BaseException | None) -> None:
        """Tear every rank down (told why when ``failure``); idempotent."""

    def outputs(self) -> list[Path]:
        """The per-rank files this cohort wrote (``rank_N.log``)."""


def run_cohort(
    cohort: Cohort, stop_requested: Callable[[], bool], gate: Callable[[], None] | None = None
) -> ControllerResult:
    """Start, join and stop ``cohort``: torn down whatever happens, told why when it failed.
    ``gate``: a check still running while the ranks start; it raises to refuse the run before
    the controller plans any training."""
    try:
        cohort.start()
        if gate is not None:
            gate()
        result = cohort.join(stop_requested)
    except BaseException as exc:
        cohort.stop(exc)
        raise
    cohort.stop(None)
    return result
