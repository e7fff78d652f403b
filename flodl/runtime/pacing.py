"""CPU-rig pacing: make a CPU rank behave like a device ``1/speed`` times slower.

Every rank pads each step to end at ``start + T / speed``, where ``T`` is one nominal step time
shared by all ranks (calibrated in warm-up as ``margin x`` the slowest measured step). Pacing by
deadline keeps the realised slowdown faithful on shared VMs, where scaling a rank's own,
jittery step time is not.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Pacer:
    """Pads steps to a deadline; a no-op until :meth:`set_nominal` is called."""

    def __init__(self, speed: float = 1.0) -> None:
        if not 0 < speed <= 1.0:
            raise ValueError(f"speed={speed}: must be in (0, 1]")
        self.speed = speed
        self.nominal_s: float | None = None

    @property
    def step_s(self) -> float | None:
        return None if self.nominal_s is None else self.nominal_s / self.speed

    def set_nominal(self, nominal_s: float) -> None:
        self.nominal_s = nominal_s

    def run(self, step: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = step()
        if self.nominal_s is not None:
            deadline = start + self.nominal_s / self.speed
            delay = deadline - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        return out


def measure_step_s(step: Callable[[], object], n: int) -> float:
    """Median wall time of ``n`` calls of ``step`` (after one untimed warm-up call)."""
    step()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
