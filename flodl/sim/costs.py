"""The simulator's world: a ring all-reduce cost model, speed scenarios, and the two yardsticks
(the physical limit and a lock-step DDP model) a simulated run is measured against.

Nothing here runs flodl code; :mod:`flodl.sim.engine` drives the real controller with it.
Times are milliseconds of a virtual clock; speeds are relative (1.0 = ``base_ms`` per batch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flodl.rig.links import wire_for


@dataclass(frozen=True)
class RingAllReduce:
    """Ring all-reduce of ``n_bytes`` over ``n`` ranks: ``alpha + 2(n-1)/n * bytes/beta``, or,
    with ``link`` (a ``cluster.link`` profile), the rig's own link model (flodl/rig/links.py:
    ``2(n-1)/n * bytes * k / bw + 2(n-1) * latency``), so simulated and rig runs pay alike."""

    alpha_ms: float = 0.05  # fixed latency of one collective
    beta_gb_s: float = 12.5  # bus bandwidth, GB/s (100 Gb/s links)
    n_bytes: int = 4 * 25_000_000  # 25 M fp32 parameters
    link: str | None = None

    def ms(self, n: int) -> float:
        if n < 2:
            return 0.0
        if self.link is not None:
            wire = wire_for(self.link)
            return 0.0 if wire is None else wire.all_reduce_s(self.n_bytes, n) * 1e3
        return self.alpha_ms + 2.0 * (n - 1) / n * self.n_bytes / (self.beta_gb_s * 1e9) * 1e3

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_bytes": self.n_bytes}
        if self.link is not None:
            return out | {"link": self.link}
        return out | {"alpha_ms": self.alpha_ms, "beta_gb_s": self.beta_gb_s}


SpeedFn = Callable[[int, float], float]  # (rank, virtual ms) -> relative speed


@dataclass(frozen=True)
class Scenario:
    """Relative speeds over virtual time, and optionally a rank lost at ``lost_at`` (fraction of
    the ideal run time, so the loss lands mid-run whatever the world size)."""

    name: str
    speed: SpeedFn
    lost_rank: int | None = None
    lost_at: float = 0.0
    params: dict[str, object] = field(default_factory=dict)


def _lognormal(n: int, sigma: float, rng: random.Random) -> list[float]:
    return [math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def make_scenario(name: str, n: int, horizon_ms: float, seed: int = 0) -> Scenario:
    """One of :data:`SCENARIOS` for ``n`` ranks; ``horizon_ms`` places mid-run events."""
    rng = random.Random(seed)
    if name == "two_tiers":
        tiers = [1.0 if r < (n + 1) // 2 else 0.4 for r in range(n)]
        return Scenario(name, lambda r, t: tiers[r], params={"tiers": [1.0, 0.4]})
    if name == "lognormal":
        speeds = _lognormal(n, 0.3, rng)
        return Scenario(name, lambda r, t: speeds[r], params={"sigma": 0.3})
    if name == "straggler":
        return Scenario(
            name, lambda r, t: 0.1 if r == n - 1 else 1.0, params={"straggler_speed": 0.1}
        )
    if name == "drift":
        return _drift(n, horizon_ms, rng)
    if name == "lost_rank":
        speeds = _lognormal(n, 0.3, rng)
        return Scenario(
            name, lambda r, t: speeds[r], lost_rank=n - 1, lost_at=0.25, params={"sigma": 0.3}
        )
    raise ValueError(f"scenario={name!r}: unknown; use one of {', '.join(SCENARIOS)}")


def _drift(n: int, horizon_ms: float, rng: random.Random) -> Scenario:
    """Lognormal speeds that move linearly to a fresh lognormal draw between 30 % and 60 % of
    the run (the slow ranks change: a thermal throttle, a neighbour's job)."""
    before, after = _lognormal(n, 0.3, rng), _lognormal(n, 0.3, rng)
    t0, t1 = 0.3 * horizon_ms, 0.6 * horizon_ms

    def speed(r: int, t: float) -> float:
        x = min(1.0, max(0.0, (t - t0) / (t1 - t0)))
        return before[r] * (1.0 - x) + after[r] * x

    return Scenario("drift", speed, params={"sigma": 0.3, "from": 0.3, "to": 0.6})


SCENARIOS = ("two_tiers", "lognormal", "straggler", "drift", "lost_rank")


@dataclass(frozen=True)
class Workload:
    """What one rank's batch costs: ``base_ms / speed`` with per-batch lognormal jitter."""

    base_ms: float = 50.0
    batch_size: int = 32
    jitter: float = 0.05
    backward_fraction: float = 2.0 / 3.0  # of a step: what DDP can overlap its all-reduce with

    def to_dict(self) -> dict[str, float]:
        return {
            "base_ms": self.base_ms,
            "batch_size": self.batch_size,
            "jitter": self.jitter,
            "backward_fraction": self.backward_fraction,
        }


def ideal_ms(
    total_samples: int, scenario: Scenario, n: int, work: Workload, lost_ms: float
) -> float:
    """The physical limit: when every alive rank computing flat out, with free communication,
    has processed ``total_samples`` (the capacity curve integrated in small steps)."""
    horizon = total_samples * work.base_ms / (work.batch_size * n * 0.05)  # safe upper bound
    dt, t, done = horizon / 4000.0, 0.0, 0.0
    while done < total_samples:
        alive = [r for r in range(n) if r != scenario.lost_rank or t < lost_ms]
        rate = sum(scenario.speed(r, t) for r in alive) * work.batch_size / work.base_ms
        step = min(dt, (total_samples - done) / rate)
        done += rate * step
        t += step
    return t


def lockstep_ms(
    total_samples: int,
    scenario: Scenario,
    n: int,
    work: Workload,
    comm: RingAllReduce,
    lost_ms: float,
    seed: int = 0,
) -> float:
    """Lock-step DDP: every alive rank does one batch per step; the step lasts as long as the
    slowest rank's batch plus the part of the all-reduce its backward could not hide. A lost
    rank costs nothing but its share (kinder to DDP than a torchrun restart)."""
    rng = random.Random(seed + 1)
    t, done = 0.0, 0
    while done < total_samples:
        alive = [r for r in range(n) if r != scenario.lost_rank or t < lost_ms]
        slow = max(batch_ms(work, scenario.speed(r, t), rng) for r in alive)
        exposed = max(0.0, comm.ms(len(alive)) - work.backward_fraction * slow)
        t += slow + exposed
        done += len(alive) * work.batch_size
    return t


def batch_ms(work: Workload, speed: float, rng: random.Random) -> float:
    """One batch at ``speed`` with its jitter."""
    noise = math.exp(rng.gauss(0.0, work.jitter)) if work.jitter > 0 else 1.0
    return work.base_ms / speed * noise
