"""The model the calibration steps run on, without a second copy of the weights when that is safe.

Timing warm-up steps (:meth:`flodl.runtime.worker.Worker.calibrate`) must not move the weights
every rank starts from. A deep copy of the model does that at the cost of one copy of the
weights *at the rank's peak* (the copy's optimizer step runs while the real model exists). For
the optimizers of ``torch.optim`` whose every parameter update is scaled by the learning rate,
the same steps run on the real model with a throwaway optimizer at ``lr = 0`` instead: each
update is ``p += -0.0 * x``, which leaves ``p`` bit for bit as it was, at the step's full cost.
Float buffers (BatchNorm statistics, which a forward pass updates) are copied and put back, and
a checksum of the parameters, taken in bounded spans, proves the weights did not move.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

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
