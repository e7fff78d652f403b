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
