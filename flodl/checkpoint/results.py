"""What a run leaves: the trained parameters and buffers (:class:`TrainedState`, ``model.pt``)
and, with them, the summary and the per-epoch and per-sync records (:class:`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn

from flodl.monitor.metrics import EpochMetrics, RunSummary, SyncEvent


@dataclass
class TrainedState:
    """The averaged parameters and buffers, on CPU. With a frozen base (LoRA adapters), only
    the trainable parameters: ``base`` is the frozen parameters' fingerprint, and
    :meth:`load_into` loads onto a model built with that same base only."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    base: str | None = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.buffers}

    def load_into(self, model: nn.Module, strict: bool = True) -> nn.Module:
        if self.base is None:
            model.load_state_dict(self.state_dict(), strict=strict)
            return model
        from flodl.runtime.sync.trainable import load_trainable

        load_trainable(model, self.state_dict(), self.base, "the trained state")
        return model

    def save(self, path: str | Path | BinaryIO) -> None:
        blob = {"params": self.params, "buffers": self.buffers}
        torch.save(blob if self.base is None else {**blob, "base": self.base}, path)

    @classmethod
    def load(cls, path: str | Path) -> TrainedState:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return cls(params=blob["params"], buffers=blob["buffers"], base=blob.get("base"))


@dataclass
class RunResult:
    state: TrainedState | None
    summary: RunSummary
    epochs: list[EpochMetrics] = field(default_factory=list)
    events: list[SyncEvent] = field(default_factory=list)
    coverage_exact: bool = False
