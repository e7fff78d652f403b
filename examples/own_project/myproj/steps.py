"""The project's train step: ``fn(model, batch) -> loss`` (``task.train_step``)."""

from __future__ import annotations

from torch import nn


def train_step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def broken_step(model, batch):
    """For trying a failed job: ``flodl train task.train_step=myproj.steps.broken_step``
    exits 1."""
    raise RuntimeError("broken_step: this train step always fails")
