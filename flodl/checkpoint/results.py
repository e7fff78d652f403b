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
    """The averaged parameters and buffers, on CPU."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.buffers}

    def load_into(self, model: nn.Module, strict: bool = True) -> nn.Module:
        model.load_state_dict(self.state_dict(), strict=strict)
        return model

    def save(self, path: str | Path | BinaryIO) -> None:
        torch.save({"params": self.params, "buffers": self.buffers}, path)

    @classmethod
    def load(cls, path: str | Path) -> TrainedState:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return cls(params=blob["params"], buffers=blob["buffers"])


@dataclass
class RunResult:
    state: TrainedState | None
    summary: RunSummary
    epochs: list[EpochMetrics] = field(default_factory=list)
    events: list[SyncEvent] = field(default_factory=list)
    coverage_exact: bool = False
