"""The project's model: built on each rank from its config (``model._target_``)."""

from __future__ import annotations

from torch import nn


class TinyNet(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x):
        return self.net(x)
