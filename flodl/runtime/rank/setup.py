"""What a rank's parts read, built once and frozen, in the order the data makes necessary.

:class:`ModelParts` comes first (the model, the flat buffer averaging works in place on, the
step runner); the memory plan (:mod:`flodl.runtime.rank.memory_plan`) takes it with the rank's
data and returns the final batch size and optimizer; :class:`RankSetup` is then built from all
of them. A part is built from the fields it reads (no part takes the rank loop), so none can be
built before what it reads exists: that, not a comment, keeps the build's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flodl.config import LoaderConfig, TrainerConfig
from flodl.config.registries.plan_elements import PLAN_ELEMENTS, elements_of
from flodl.data.source import BatchSource
from flodl.rig.pacing import Pacer
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.trainable import base_fingerprint
from flodl.runtime.wire.job_spec import JobSpec
from flodl.step.precision import StepRunner, compiled


@dataclass(frozen=True)
class ModelParts:
    """The rank's model as built: the module averaging, checkpoints and the final state read,
    the one the step runs (compiled or the same), the flat buffer the parameters live in, the
    frozen parameters' fingerprint and the step runner (precision, accumulation, clipping)."""

    model: nn.Module
    train_model: nn.Module
    state: FlatState
    base: Any
    runner: StepRunner
    device: torch.device  # where the model lives

    @classmethod
    def build(cls, spec: JobSpec, device: torch.device) -> ModelParts:
        cfg = spec.config
        torch.manual_seed(cfg.seed)
        model = spec.model_factory(device)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(model)}")
        model.to(device).train()
        # Before the optimizer: parameters move into one buffer the collectives use in place.
        state = FlatState(model, share_storage=True)
        base = base_fingerprint(model)  # the frozen parameters' (None: all train)
        train_model = compiled(model) if cfg.compile else model
        runner = StepRunner(cfg.precision, device, cfg.accumulate_grad_batches, cfg.max_grad_norm)
        return cls(model, train_model, state, base, runner, device)


@dataclass(frozen=True)
class RankSetup:
    """What the rank's parts read, final once the memory plan is applied: its identity and
    job, its link, pacer and model, the optimizer and data as the plan left them."""

    spec: JobSpec
    rank: int
    device: torch.device
    link: Any
    pacer: Pacer
    parts: ModelParts
    optimizer: torch.optim.Optimizer
    source: BatchSource
    loader_cfg: LoaderConfig

    @property
    def cfg(self) -> TrainerConfig:
        return self.spec.config

    @property
    def batch_size(self) -> int:
        return int(self.source.batch_size)

    @property
    def model(self) -> nn.Module:
        return self.parts.model


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's plan, as chosen (or configured) and announced."""

    elements: tuple[str, ...] = ()
    batch_size: int = 0
    budget_bytes: int | None = None
    peak_bytes: int | None = None  # the chosen plan's probe peak (None: not probed)
    requested_batch: int = 0
    # shard (flodl/runtime/rank/shard_plan.py): what the rank tells the cohort before the cut
    free_bytes: int | None = None  # device memory free for optimizer state (None: not counted)
    state_bytes: int = 0  # the whole optimizer state's cost on the device (0: not measured)
    share: float | None = None  # the fraction of the state it holds, once cut

    @property
    def recomputes(self) -> bool:
        """Its step runs forward again in backward (calibration times the extra cost)."""
        return any(e.recomputes for e in elements_of(self.elements))

    @property
    def cohort(self) -> bool:
        """Part of its state is cut across the cohort (``shard``)."""
        return any(e.cohort for e in elements_of(self.elements))

    @property
    def state_on_host(self) -> bool:
        """Its optimizer state is in host memory (``offload``): it holds no share of a cut."""
        return any("state" in e.to_host for e in elements_of(self.elements))

    def describe(self, rank: int) -> str:
        """``rank 2 (12.0 GB): batch 8, activation checkpointing, optimizer state on host``;
        empty when there was nothing to plan (no budget, no plan configured)."""
        if not self.budget_bytes and not self.elements:
            return ""
        budget = f" ({size_text(self.budget_bytes)})" if self.budget_bytes else ""
        batch = f"batch {self.batch_size}"
        if self.requested_batch and self.requested_batch != self.batch_size:
            batch += f" (of {self.requested_batch})"
        parts = [batch, *(self._words(e) for e in self.elements)] if self.elements else [batch]
        if not self.elements:
            parts.append("no plan needed" if self.peak_bytes is not None else "no plan")
        peak = f"; probe peak {size_text(self.peak_bytes)}" if self.peak_bytes is not None else ""
        return f"rank {rank}{budget}: {', '.join(parts)}{peak}"

    def _words(self, element: str) -> str:
        declared = PLAN_ELEMENTS[element]
        if declared.cohort and self.share is not None:
            return f"{declared.words} ({100 * self.share:.0f} % of it)"
        return declared.words


def size_text(nbytes: int) -> str:
    """``12.0 GiB`` or ``300 MiB``: a size as the announcements say it."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
