"""Learning-rate schedules on one global progress clock, so every rank agrees on the LR.

With ``scheduler.interval: step`` a rank's scheduler is not stepped once per local batch (ranks
take unequal numbers of steps under ElChe) but *advanced to a target step* derived from the
run's global progress: the samples of the run dispatched before the current point, over all
ranks. The controller stamps every window with the global samples before it and in it; inside a
window a rank interpolates by its own share of the window. The target is the same function of
global progress on every rank, so warm-up and cosine agree across ranks at equal progress, and a
resumed run (whose progress is derived from the saved epoch and coverage) lands on the same step.

One *global step* is one global batch: ``sum of the ranks' batch sizes x accumulate_grad_batches``
samples, the step a DDP run of the same global batch would take; ``total_steps`` (when a schedule
asks for ``auto``) is the run's length in those steps.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# Schedulers meant to be stepped once per optimizer step; under interval=epoch they barely move.
PER_STEP_SCHEDULERS = ("OneCycleLR", "CyclicLR", "WarmupCosine")


class _WarmupCosineFactor:
    """``lr_lambda`` of :class:`WarmupCosine` (a callable object, so its state is saved)."""

    def __init__(self, total_steps: int, warmup_steps: int, floor: float) -> None:
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.floor = floor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``warmup_fraction`` of the run, then cosine down to ``floor x lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_fraction: float = 0.05,
        floor: float = 0.0,
    ) -> None:
        if not 0 <= warmup_fraction < 1:
            raise ValueError(f"scheduler.warmup_fraction={warmup_fraction}: must be in [0, 1)")
        if not 0 <= floor <= 1:
            raise ValueError(f"scheduler.floor={floor}: must be in [0, 1] (a fraction of the lr)")
        if total_steps < 1:
            raise ValueError(f"scheduler.total_steps={total_steps}: must be >= 1")
        warmup = round(warmup_fraction * total_steps)
        super().__init__(optimizer, _WarmupCosineFactor(total_steps, warmup, floor))


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_fraction: float = 0.05,
    floor: float = 0.0,
) -> WarmupCosine:
    """The ``conf/scheduler/warmup_cosine.yaml`` preset's target."""
    return WarmupCosine(optimizer, total_steps, warmup_fraction, floor)


def is_per_step(scheduler: Any) -> bool:
    """A scheduler known to be meant per optimizer step (OneCycleLR, CyclicLR, WarmupCosine)."""
    return any(cls.__name__ in PER_STEP_SCHEDULERS for cls in type(scheduler).__mro__)


@dataclass(frozen=True)
class RunLength:
    """How long the run is, in samples and in global steps."""

    samples: int  # num_epochs x dataset length
    global_batch: int  # samples of one global step

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.samples / self.global_batch))

    def target_step(self, global_samples: float) -> int:
        """The scheduler step at ``global_samples`` of the run (0 .. total_steps)."""
        done = min(max(global_samples, 0.0), float(self.samples))
        return min(self.total_steps, math.floor(self.total_steps * done / self.samples + 1e-9))


def global_samples(before: int, in_window: int, own_done: int, own_total: int) -> float:
    """Global progress inside a window from this rank's own progress through its share.

    ``before``: samples of the run dispatched before the window (all ranks); ``in_window``: the
    window's samples over all ranks. Ranks' shares are throughput-proportional, so each rank's
    fraction of its own share estimates the fraction of the window the cohort has done; at the
    window's end every rank is exactly at ``before + in_window``.
    """
    if own_total <= 0:
        return float(before + in_window)
    return before + in_window * min(own_done, own_total) / own_total


def advance_to(scheduler: Any, target: int) -> int:
    """Step ``scheduler`` until its step count reaches ``target`` (never backwards).

    Clamped to a scheduler's own ``total_steps`` when it has one (OneCycleLR refuses to step
    past it). Returns the number of steps taken.
    """
    limit = getattr(scheduler, "total_steps", None)
    if isinstance(limit, int):
        target = min(target, limit)
    taken = 0
    while scheduler.last_epoch < target:
        scheduler.step()
        taken += 1
    return taken


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def fill_total_steps(
    target: Any, kwargs: dict[str, Any], total_steps: int | None
) -> dict[str, Any]:
    """Replace ``total_steps: auto`` with the run's length; supply it where the target takes
    ``total_steps`` and neither it nor ``epochs`` (OneCycleLR's alternative) was given."""
    kwargs = dict(kwargs)
    value = kwargs.get("total_steps")
    wants = "total_steps" in _parameters(target) and "epochs" not in kwargs
    if value == "auto" or (value is None and wants):
        if total_steps is None:
            raise ValueError(
                "scheduler.total_steps=auto: the run's length is only known when flodl builds "
                "the scheduler (give a number to build it yourself)"
            )
        kwargs["total_steps"] = total_steps
    return kwargs


def build(factory: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """Call a scheduler factory; one that takes ``total_steps`` gets the run's length."""
    if "total_steps" in _parameters(factory):
        return factory(optimizer, total_steps=total_steps)
    return factory(optimizer)
