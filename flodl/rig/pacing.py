"""CPU-rig pacing: make a CPU rank behave like a device ``1/speed`` times slower; and the
calibration steps that measure it, without a second copy of the weights (:func:`probe_model`).

Every rank pads each step to end at ``start + T / speed``, where ``T`` is one nominal step time
shared by all ranks (calibrated in warm-up as ``margin x`` the slowest measured step). Pacing by
deadline keeps the realised slowdown faithful on shared VMs, where scaling a rank's own,
jittery step time is not.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from flodl.rig import links

T = TypeVar("T")


class Pacer:
    """Pads steps to a deadline; a no-op until :meth:`set_nominal` is called."""

    def __init__(self, speed: float = 1.0) -> None:
        if not 0 < speed <= 1.0:
            raise ValueError(f"speed={speed}: must be in (0, 1]")
        self.speed = speed
        self.nominal_s: float | None = None
        # Seconds the paced steps ran past their deadlines: the step itself took longer than
        # the simulated device's. On a CPU rig that means the cores are oversubscribed (loader
        # workers, other ranks, other processes), and the simulated speed ratio is not held.
        self.overrun_s = 0.0
        self._exempt_s = 0.0  # of the step in progress: waiting in a collective (not counted)
        # A memory plan's costs on the simulated device: recomputing activations makes every step
        # ``cost`` times longer; an offloaded optimizer step adds its host time (:meth:`charge`).
        self.cost = 1.0
        self._charged_s = 0.0
        self.charged_s = 0.0  # all charges so far

    @property
    def step_s(self) -> float | None:
        return None if self.nominal_s is None else self.nominal_s * self.cost / self.speed

    def set_nominal(self, nominal_s: float) -> None:
        self.nominal_s = nominal_s

    def run(self, step: Callable[[], T]) -> T:
        """Run one step and pad it to its deadline; with a modelled link (``cluster.link``) the
        step also ends no sooner than its transfers do (placed on the simulated timeline)."""
        link = links.installed()
        if link is not None:
            link.open_step()
        start = time.perf_counter()
        self._exempt_s = 0.0
        self._charged_s = 0.0
        try:
            out = step()
        except BaseException:
            if link is not None:
                link.settle_step(0.0, None)  # closed: the next step starts its own
            raise
        real_s = time.perf_counter() - start
        if self.nominal_s is not None:  # paced (else: no CPU rig, or before calibration)
            deadline = start + self.nominal_s * self.cost / self.speed + self._charged_s
            delay = deadline - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                self.overrun_s += max(0.0, -delay - self._exempt_s)
        if link is not None:
            links.sleep_until(link.settle_step(real_s, self.step_s))
        return out

    def charge(self, seconds: float) -> None:
        """Simulated time the step in progress also takes (an offloaded optimizer step)."""
        self._charged_s += seconds
        self.charged_s += seconds

    def exempt(self, seconds: float) -> None:
        """Time the step in progress spent waiting in a collective (nccl_sync's gradient
        all-reduce waits for the slowest peer inside the step): a step late by that much ran
        its own work on time, so it is not an overrun."""
        self._exempt_s += seconds


def measure_step_s(step: Callable[[], object], n: int) -> float:
    """Median wall time of ``n`` calls of ``step`` (after one untimed warm-up call)."""
    step()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- calibration steps ---------------------------------------------------------------------------
#
# The model the calibration steps run on, without a second copy of the weights when that is safe.
#
# Timing warm-up steps (flodl/runtime/rank/calibration.py) must not move the weights
# every rank starts from. A deep copy of the model does that at the cost of one copy of the
# weights *at the rank's peak* (the copy's optimizer step runs while the real model exists). For
# the optimizers of ``torch.optim`` whose every parameter update is scaled by the learning rate,
# the same steps run on the real model with a throwaway optimizer at ``lr = 0`` instead: each
# update is ``p += -0.0 * x``, which leaves ``p`` bit for bit as it was, at the step's full cost.
# Buffers (BatchNorm statistics and counters, which a forward pass updates) are copied and put
# back, and a checksum of the parameters, taken in bounded spans, proves the weights did not move.

_SPAN = 1 << 22  # elements per checksum step (no whole-vector temporary)

#: Optimizers whose updates are all multiplied by ``lr`` (so ``lr = 0`` moves nothing).
LR_SCALED = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta")


def in_place_ok(optimizer: torch.optim.Optimizer) -> bool:
    """Whether warm-up steps of this optimizer at ``lr = 0`` leave the weights untouched."""
    known = type(optimizer).__module__.startswith("torch.optim") and (
        type(optimizer).__name__ in LR_SCALED
    )
    return known and all(isinstance(g.get("lr"), float | int) for g in optimizer.param_groups)


def checksum(model: nn.Module) -> list[tuple[float, float]]:
    """Per parameter, the float64 sum and sum of squares, span by span."""
    out = []
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            total, squares = 0.0, 0.0
            for lo in range(0, flat.numel(), _SPAN):
                span = flat[lo : lo + _SPAN].to(torch.float64)
                total += float(span.sum())
                squares += float(span.square().sum())
            out.append((total, squares))
    return out


def _finite_grads(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


@contextmanager
def probe_model(
    model: nn.Module, optim_factory: Callable[[Any], torch.optim.Optimizer]
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """``(model, optimizer)`` to time steps on; afterwards the real model is as it was."""
    optimizer = optim_factory(model.parameters())
    if not in_place_ok(optimizer):
        del optimizer
        probe = copy.deepcopy(model)
        yield probe, optim_factory(probe.parameters())
        return
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    # 0 * NaN is NaN: a non-finite gradient (a NaN loss in the first steps, which training then
    # skips and counts against trainer.max_nonfinite) would move the weights. The throwaway
    # gradients are made finite before each step, at about the cost of one more pass over them.
    optimizer.register_step_pre_hook(_finite_grads)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    before = checksum(model)
    try:
        yield model, optimizer
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
    if checksum(model) != before:
        raise RuntimeError(
            "calibration: a warm-up step at lr=0 changed the weights (non-finite gradients in "
            "the first steps?); check the model's initialisation and the loss"
        )
