"""The elements of a memory plan (flodl/step/plan_elements.py), the rig's charges for them, their
config and the launch-time refusals: pure logic and single-process torch, no ranks."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from flodl.config import ClusterConfig, ConfigError
from flodl.config.cluster import parse_memory_plan
from flodl.preflight.footprint import check_memory, footprint
from flodl.rig.device_memory import DeviceMemory, MiB, offload_step_s, training_state
from flodl.rig.pacing import Pacer
from flodl.runtime.sync.averaging import FlatState
from flodl.step.plan_elements import HostOptimizer, blocks, recompute, recompute_off, recomputes


def _mlp(seed: int = 0, width: int = 64, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Stack(nn.Module):
    """A transformer-like stack: compound blocks in a ModuleList between two layers."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


# -- activation recomputation ---------------------------------------------------------------------
@pytest.mark.parametrize("build", [_mlp, Stack], ids=["flat-sequential", "compound-blocks"])
def test_recomputed_gradients_equal_the_plain_ones(build):
    x = torch.randn(8, 16)
    plain, planned = build(), build()
    planned.load_state_dict(plain.state_dict())
    assert recompute(planned) >= 1 and recomputes(planned)
    for g, h in zip(_grads(plain, x), _grads(planned, x), strict=True):
        torch.testing.assert_close(g, h)
    assert list(plain.state_dict()) == list(planned.state_dict())  # names untouched


def test_blocks_are_the_compound_elements_or_a_segmented_sequential():
    stack = Stack()
    each, seq = blocks(stack)
    assert seq is None and each == list(stack.blocks)
    mlp = _mlp()
    each, seq = blocks(mlp)
    assert each == [] and seq is mlp
    lone = nn.Linear(4, 4)
    assert blocks(lone) == ([lone], None)


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    memory = DeviceMemory(None)
    memory.adopt(training_state(model))
    with memory:
        memory.reset_peak()
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return memory.peak


@pytest.mark.parametrize(
    ("build", "most"),
    [(lambda: _mlp(width=256, depth=8), 0.75), (lambda: Stack(64, 8), 0.5)],
    ids=["flat-sequential", "compound-blocks"],
)
def test_recomputation_lowers_the_counted_peak_and_can_be_switched_off(build, most):
    x = torch.randn(2048, 16)  # activations (MiBs) dominate the parameters (KiBs)
    model = build()
    plain = _peak(model, x)
    recompute(model)
    planned = _peak(model, x)
    assert planned < most * plain, (planned, plain)
    with recompute_off(model):
        assert _peak(model, x) == plain


def test_a_deep_copy_of_a_recomputed_model_runs_its_own_weights():
    model = Stack()
    recompute(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(2, 16, requires_grad=True)
    assert torch.count_nonzero(twin(x)) == 0  # not the original's weights
    assert torch.count_nonzero(model(x)) > 0


# -- optimizer state on host ----------------------------------------------------------------------
OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_host_steps_equal_device_steps_and_their_state_is_interchangeable(name):
    factory = OPTIMIZERS[name]
    plain, hosted = _mlp(), _mlp()
    plain_opt = factory(plain.parameters())
    host_opt = HostOptimizer(hosted.parameters(), factory)
    _train(plain, plain_opt, 5)
    _train(hosted, host_opt, 5)
    for p, q in zip(plain.parameters(), hosted.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # A bundle saved with the plan resumes without it, and the other way round.
    swapped_plain = factory(hosted.parameters())
    swapped_plain.load_state_dict(host_opt.state_dict())
    swapped_host = HostOptimizer(plain.parameters(), factory)
    swapped_host.load_state_dict(plain_opt.state_dict())
    _train(hosted, swapped_plain, 3, seed=2)
    _train(plain, swapped_host, 3, seed=2)
    for p, q in zip(plain.parameters(), hosted.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_weights_changed_on_the_device_are_moved_down_before_the_next_step():
    """An average (or a restore) writes the device weights in place, through one flat buffer
    whose views share a version counter: the host copy must follow, or the next step would
    undo the average."""
    model = _mlp()
    state = FlatState(model, share_storage=True)
    opt = HostOptimizer(
        model.parameters(), OPTIMIZERS["sgd-momentum"], watch=lambda: [state.shared()]
    )
    _train(model, opt, 2)
    averaged = torch.full_like(state.current(), 0.01)
    state.load(averaged)  # what collective_average does
    twin = _mlp()
    twin.load_state_dict(model.state_dict())
    twin_opt = OPTIMIZERS["sgd-momentum"](twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not aliasing its buffers
    _train(model, opt, 1, seed=3)
    _train(twin, twin_opt, 1, seed=3)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_the_host_state_never_counts_against_the_device():
    model = _mlp(width=256)
    memory = DeviceMemory(None)
    memory.adopt(training_state(model))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with memory:
        opt = HostOptimizer(model.parameters(), OPTIMIZERS["adam"], host=memory.host)
        _train(model, opt, 2)
    assert 2 * params <= opt.state_bytes() < 2 * params + 1024  # Adam's moments (and steps)
    assert memory.peak < params * 2 + 2 * MiB  # parameters + gradients + activations


def test_a_scheduler_drives_the_host_optimizer_lr():
    model = _mlp()
    opt = HostOptimizer(model.parameters(), OPTIMIZERS["sgd-momentum"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, 1)
    sched.step()
    _train(model, opt, 1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.05)


def test_closures_are_refused():
    opt = HostOptimizer(_mlp().parameters(), OPTIMIZERS["adam"])
    with pytest.raises(ValueError, match="closures"):
        opt.step(lambda: 0.0)


# -- what the rig charges -------------------------------------------------------------------------
def test_offload_charges_pcie_traffic_and_a_memory_bound_host_step():
    gb = 10**9
    # 1 GB over ~25 GB/s PCIe and a host step streaming 2 x 1 GB at 20 GB/s.
    assert offload_step_s(gb, 0) == pytest.approx(0.04, rel=0.01)
    assert offload_step_s(0, gb) == pytest.approx(0.1, rel=0.01)
    assert offload_step_s(0, 0) == 0.0


def test_the_pacer_stretches_steps_by_the_plan_cost_and_its_charges():
    pacer = Pacer(1.0)
    pacer.set_nominal(0.04)
    pacer.cost = 2.0
    t0 = time.perf_counter()
    pacer.run(lambda: pacer.charge(0.03))
    elapsed = time.perf_counter() - t0
    assert 0.11 - 0.005 <= elapsed < 0.3  # 0.04 x 2 + 0.03
    assert pacer.charged_s == pytest.approx(0.03) and pacer.step_s == pytest.approx(0.08)


# -- the config and the launch refusals -----------------------------------------------------------
def test_plans_parse_and_bad_ones_are_refused():
    assert parse_memory_plan("auto") is None and parse_memory_plan("none") == ()
    assert parse_memory_plan("offload+recompute") == ("recompute", "offload")
    for bad in ("swap", "recompute+recompute", "", "offload+"):
        with pytest.raises(ValueError, match="memory plan"):
            parse_memory_plan(bad)
    with pytest.raises(ValueError, match="memory_plan has 1 entries but ranks=2"):
        ClusterConfig(kind="cpu_rig", ranks=2, memory_plan=["auto"])
    with pytest.raises(ValueError, match="memory plan 'zero'"):
        ClusterConfig(kind="cpu_rig", ranks=2, memory_plan=["auto", "zero"])
    cfg = ClusterConfig(kind="cpu_rig", ranks=2, memory_mb=[100, 50], memory_plan=["none", "auto"])
    assert cfg.rank_memory_plan(1) == "auto" and cfg.plans_choose_batches()
    assert not ClusterConfig(kind="cpu_rig", ranks=2, memory_plan="auto").plans_choose_batches()


class _Spec:
    def __init__(self, memory_mb, plan="auto", width=1024):
        from flodl.config import TrainerConfig

        self.config = TrainerConfig(
            cluster=ClusterConfig(kind="cpu_rig", ranks=2, memory_mb=memory_mb, memory_plan=plan)
        )
        self.model_factory = lambda device: nn.Sequential(
            nn.Linear(1024, width), nn.Linear(width, 8)
        )
        self.optim_factory = OPTIMIZERS["adam"]


def test_the_footprint_is_sized_on_meta():
    fp = footprint(_Spec(100))
    params = (1024 * 1024 + 1024 + 1024 * 8 + 8) * 4
    assert fp is not None and fp.params == fp.grads == params and fp.optimizer >= 2 * params


def test_a_budget_below_parameters_and_gradients_is_refused_with_the_numbers():
    # ~4.2 MiB of parameters and as much of gradients against 6 MiB.
    with pytest.raises(
        ConfigError,
        match=r"rank 1 needs >= 8\.\d MiB for parameters and gradients.*its budget is 6\.0 MiB",
    ):
        check_memory(_Spec([100, 6]), 2)
    check_memory(_Spec([100, 6], plan=["auto", "none"]), 2)  # none: it fails out of memory


def test_an_explicit_plan_without_offload_must_hold_the_optimizer_state():
    with pytest.raises(
        ConfigError, match=r"memory_plan=recompute: rank 1 needs >= 1[67]\.\d MiB .* Add offload"
    ):
        check_memory(_Spec([100, 12], plan=["auto", "recompute"]), 2)
    check_memory(_Spec([100, 12], plan=["auto", "offload"]), 2)
    check_memory(_Spec([100, 12]), 2)  # auto: it will offload


def test_a_frozen_base_gets_no_host_copy_and_the_state_still_interchanges():
    """LoRA's shape: a frozen base beside trainable matrices. Offloading keeps no host copy of
    the base (a placeholder holds its place in the state's order), steps like the plain
    optimizer, and the two load each other's state."""

    def build() -> nn.Sequential:
        model = _mlp()
        for p in model[0].parameters():  # the first layer plays the frozen base
            p.requires_grad_(False)
        return model

    plain, hosted = build(), build()
    factory = OPTIMIZERS["adam"]
    plain_opt = factory(plain.parameters())
    host_opt = HostOptimizer(hosted.parameters(), factory)
    frozen = sum(p.numel() for p in hosted[0].parameters())
    assert frozen > 0 and all(h.numel() == 0 for h in host_opt.host_params[:2])
    _train(plain, plain_opt, 3)
    _train(hosted, host_opt, 3)
    for p, q in zip(plain.parameters(), hosted.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    factory(plain.parameters()).load_state_dict(copy.deepcopy(host_opt.state_dict()))
    HostOptimizer(plain.parameters(), factory).load_state_dict(
        copy.deepcopy(plain_opt.state_dict())
    )
