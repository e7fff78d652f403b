"""Calibration steps leave the weights as they were, without a copy for lr-scaled optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl.rig.pacing import in_place_ok, probe_model


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int = 3) -> None:
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(torch.randn(16, 6)), torch.randint(0, 3, (16,)))
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize(
    "factory",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    ],
)
def test_in_place_steps_move_nothing(factory) -> None:
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with probe_model(model, factory) as (probe, optimizer):
        assert probe is model  # no copy of the weights
        assert all(g["lr"] == 0.0 for g in optimizer.param_groups)
        _steps(probe, optimizer)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())


def test_other_optimizers_step_a_copy() -> None:
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    factory = lambda p: torch.optim.Rprop(p, lr=1e-2)  # noqa: E731  (updates not lr-scaled)
    assert not in_place_ok(factory(model.parameters()))
    with probe_model(model, factory) as (probe, optimizer):
        assert probe is not model
        _steps(probe, optimizer)
    assert all(torch.equal(before[k], model.state_dict()[k]) for k in before)


def test_moved_weights_are_an_error() -> None:
    model = _net()
    moved = pytest.raises(RuntimeError, match="changed the weights")
    with moved, probe_model(model, lambda p: torch.optim.Adam(p)) as (probe, _), torch.no_grad():
        next(probe.parameters()).add_(1.0)
