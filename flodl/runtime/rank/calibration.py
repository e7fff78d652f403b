"""Calibration: the nominal step time the ranks agree on before training (CPU rig), and what a
recompute plan costs a step on this rank (its simulated device is slowed by as much).

Pace by deadline (docs: the CPU rig): every paced rank pads each step to end at
``start + T / speed``; ``T`` is measured here, by all ranks together, on warm-up steps that leave
the weights as they were.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.config import LoaderConfig, TrainerConfig
from flodl.data.source import BatchSource
from flodl.monitor.metrics import drain_scalars
from flodl.rig.pacing import Pacer, measure_step_s, probe_model
from flodl.runtime.rank import blame
from flodl.runtime.rank.memory_plan import RankMemory
from flodl.runtime.wire import chaos
from flodl.runtime.wire.job_spec import JobSpec
from flodl.step.precision import StepRunner


@dataclass(frozen=True)
class Calibration:
    """The warm-up timing of one rank, from what it reads of the rank once built: its model,
    data, step runner, pacer, memory and plan, and the start-up collective (``together``)."""

    rank: int
    spec: JobSpec
    model: nn.Module
    runner: StepRunner
    source: BatchSource
    loader_cfg: LoaderConfig
    pacer: Pacer
    memory: RankMemory  # unplanned(): steps as the device runs them; host(): off the budget
    recomputes: bool  # the plan recomputes activations: the step's extra cost is measured
    together: Callable[..., None]  # a start-up collective; fails as CohortBroke

    @property
    def cfg(self) -> TrainerConfig:
        return self.spec.config

    @property
    def batch_size(self) -> int:
        return int(self.source.batch_size)

    def calibrate(self) -> float:
        """Time warm-up steps that leave the weights as they were (``pacing.probe_model``: at
        lr=0 on the model itself, else on a copy); agree on one nominal step time (CPU rig).
        Nothing paced (a GPU, a solo run without rig speeds): no steps, 0.0 (the controller
        plans from the ranks' reports; a probe copy of a large model would only raise the peak)."""
        if not self.spec.pace:
            return 0.0
        with (
            self.memory.unplanned(self.model),
            probe_model(self.model, self.spec.optim_factory) as pair,
        ):
            step_s = self._time_steps(*pair)
        t = torch.tensor([step_s], dtype=torch.float64)
        self.together(t, op=dist.ReduceOp.MAX)
        step_s = float(t.item())
        if self.spec.pace:
            self.pacer.set_nominal(step_s * self.cfg.cluster.pace_margin)
            if self.recomputes:
                self.pacer.cost = self._recompute_cost()
        drain_scalars()
        return step_s * 1000.0

    def _recompute_cost(self) -> float:
        """How much longer a step with activations recomputed takes than one without, on this
        rank (interleaved medians): its simulated device is slowed by as much."""
        from flodl.step.plan_elements import recompute_off

        on, off = [], []
        with self.memory.host(), probe_model(self.model, self.spec.optim_factory) as pair:
            step = self._plain_step(*pair)
            for _ in range(3):
                on.append(measure_step_s(step, max(1, self.cfg.cluster.warmup_steps // 3)))
                with recompute_off(self.model):
                    off.append(measure_step_s(step, max(1, self.cfg.cluster.warmup_steps // 3)))
        cost = statistics.median(on) / max(statistics.median(off), 1e-9)
        return min(max(cost, 1.0), 3.0)

    def _time_steps(self, probe: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        step = self._plain_step(probe, optimizer)
        # Measure together: a rank still importing or loading data would otherwise steal the
        # other's core and inflate the nominal step every rank is then paced to.
        self.together(torch.zeros(1))
        chaos.point("calibrate", self.rank)
        return measure_step_s(step, self.cfg.cluster.warmup_steps)

    def _plain_step(self, probe: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """One timed warm-up step of ``probe`` (a forward, backward, check and step)."""
        n = self.cfg.cluster.warmup_steps
        chunk = ((0, min(len(self.source), self.batch_size * n)),)
        # Loading in the training thread (num_workers=0, not resident) is part of every step,
        # so the nominal step covers it; workers and resident data load outside the step.
        batches: Any
        if not self.source.fast and self.loader_cfg.num_workers == 0:
            batches = (b for _ in itertools.count() for b in self.source.batches(0, chunk))
        else:
            batches = itertools.cycle(list(self.source.batches(0, chunk)))

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with blame.user_code("train_step"), self.runner.autocast():
                loss = self.spec.train_step(probe, next(batches))
            loss.backward()
            self.runner.check_gradients(probe)  # every step pays it: timed too (verdict unused)
            optimizer.step()

        return step
