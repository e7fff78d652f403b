"""The rig's simulated device memory (flodl/rig/device_memory.py): the counted peak of three models
against analytic sizes, the out-of-memory error a GPU raises, and the knob's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl.config import ClusterConfig
from flodl.rig.device_memory import DeviceMemory, training_state


def _train(model: nn.Module, opt: torch.optim.Optimizer, x, y, budget=None, steps=3):
    mem = DeviceMemory(budget)
    mem.adopt(training_state(model, opt))
    mem.adopt([x, y])
    with mem:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return mem


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 10))


def _bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_mlp_with_sgd_peaks_at_weights_and_gradients() -> None:
    """SGD keeps no state: the peak is the weights and their gradients (P each) plus the
    batch's activations (32 x 2048 floats, a sliver of P here)."""
    model = _mlp()
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    mem = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    p = _bytes(model)
    analytic = 2 * p + 3 * 32 * 2048 * 4 + x.numel() * 4
    assert mem.peak == pytest.approx(analytic, rel=0.15)


def test_mlp_with_adam_peaks_in_its_step() -> None:
    """torch's foreach Adam: weights, gradients, two moments, and two step temporaries of P
    each (``(1 - beta2) * grad`` and ``sqrt(exp_avg_sq)``): 6P."""
    model = _mlp()
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    mem = _train(model, torch.optim.Adam(model.parameters()), x, y)
    assert mem.peak == pytest.approx(6 * _bytes(model), rel=0.15)


def test_a_conv_net_peaks_on_its_activations() -> None:
    """Two 64-channel 32x32 convolutions at batch 64: activations dominate. In the second
    convolution's backward four activation-sized tensors are alive (the two ReLU outputs saved
    for backward, the incoming gradient and the one being computed), beside 2P."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 32 * 32, 10),
    )
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    mem = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    activation = 64 * 64 * 32 * 32 * 4
    analytic = 2 * _bytes(model) + 4 * activation + x.numel() * 4
    assert mem.peak == pytest.approx(analytic, rel=0.15)


def test_over_budget_is_a_cuda_like_out_of_memory_and_nothing_leaks() -> None:
    model = _mlp()
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    budget = 4 * _bytes(model)  # Adam needs 6P
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"rank out of memory .*memory_mb=24.8"):
        _train(model, torch.optim.Adam(model.parameters()), x, y, budget=budget)
    # the same run under a budget it fits trains, and frees what it allocated
    mem = _train(model, torch.optim.Adam(model.parameters()), x, y, budget=8 * _bytes(model))
    mem.sweep()
    assert mem.current <= 4.1 * _bytes(model)  # weights, gradients, two moments


def test_memory_mb_knob() -> None:
    cluster = ClusterConfig(kind="cpu_rig", ranks=3, memory_mb=[24000, 12000, 12000])
    assert [cluster.rank_memory_mb(r) for r in range(3)] == [24000, 12000, 12000]
    assert ClusterConfig(kind="cpu_rig", memory_mb=512).rank_memory_mb(1) == 512
    for bad, message in (
        ({"memory_mb": [1, 2, 3]}, "memory_mb has 3 entries but ranks=2"),
        ({"memory_mb": float("nan")}, "finite"),
        ({"memory_mb": -1}, "> 0"),
        ({"memory_mb": 100, "kind": "auto"}, "simulates device memory on the CPU rig"),
    ):
        with pytest.raises(ValueError, match=message):
            ClusterConfig(**{"kind": "cpu_rig", **bad})
