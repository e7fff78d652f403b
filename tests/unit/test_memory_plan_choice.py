"""``cluster.memory_plan: auto`` (flodl/runtime/rank/memory_plan.py): the cheapest plan whose probe
fits, in order (nothing, recomputation, offload, both; then smaller batches on the rig), on a
real model under the rig's counted memory, in one process (the rank's parts, no ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from flodl.config import ClusterConfig, TrainerConfig
from flodl.data.source import BatchSource
from flodl.recipes.steps import classification_step
from flodl.rig.device_memory import DeviceMemory, MiB, training_state
from flodl.runtime.rank.memory_plan import ProbeTarget, _Meter, _probe, choose_plan
from flodl.runtime.rank.setup import ModelParts
from flodl.runtime.rank.shard_plan import MemoryPlanError
from flodl.runtime.sync.averaging import FlatState
from flodl.step.plan_elements import recompute
from flodl.step.precision import StepRunner

CPU = torch.device("cpu")
ORDER = [(), ("recompute",), ("offload",), ("recompute", "offload")]


def _worker(budget_mib: float | None, batch: int = 512, hidden: int = 512):
    """What the plan reads of a rank (its ProbeTarget) and the rig's memory it counts in."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, hidden), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(hidden, 4))
    state = FlatState(model, share_storage=True)
    cfg = TrainerConfig(cluster=ClusterConfig(kind="cpu_rig", ranks=2, memory_mb=[100, 100]))
    memory = DeviceMemory(None, name="rank 1")
    memory.adopt(training_state(model))
    memory.budget = None if budget_mib is None else int(budget_mib * MiB)
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))
    spec = SimpleNamespace(
        config=cfg,
        optim_factory=lambda ps: torch.optim.Adam(ps, lr=1e-3),
        train_step=classification_step,
    )
    parts = ModelParts(model, model, state, None, StepRunner("32", CPU), CPU)
    source = BatchSource(data, batch, 0, CPU)
    target = ProbeTarget(spec, 1, CPU, parts, source, 2, False, False)  # type: ignore[arg-type]
    return target, memory


def _peaks(batch: int, hidden: int) -> dict[tuple[str, ...], int]:
    target, memory = _worker(None, batch, hidden)
    recompute(target.parts.model)
    memory.budget = 1 << 40  # a meter needs a budget; large: measure only
    meter = _Meter(memory, CPU, 0.9)
    with memory:
        return {plan: _probe(target, meter, batch, plan) for plan in ORDER}


#: (batch, hidden): activations dominate a step (recomputation saves most), or the optimizer's
#: state and its step's temporaries do (offload saves most).
SHAPES = {"activations": (2048, 256), "state": (16, 1024)}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request) -> tuple[tuple[int, int], dict[tuple[str, ...], int]]:
    shape = SHAPES[request.param]
    measured = _peaks(*shape)
    both = measured[("recompute", "offload")]
    assert measured[()] > both
    saver = ("recompute",) if request.param == "activations" else ("offload",)
    other = ("offload",) if request.param == "activations" else ("recompute",)
    assert measured[saver] < measured[other] <= measured[()]  # the shape does what it says
    return shape, measured


@pytest.mark.parametrize("fits", ORDER, ids=["nothing", "recompute", "offload", "both"])
def test_auto_takes_the_first_plan_in_cost_order_that_fits(shaped, fits):
    (batch, hidden), peaks = shaped
    budget = peaks[fits] / 0.9 / MiB * 1.001  # memory_fraction 0.9: this plan just fits
    expected = next(p for p in ORDER if peaks[p] <= peaks[fits] * 1.001)
    target, memory = _worker(budget, batch, hidden)
    model = target.parts.model
    before = [p.detach().clone() for p in model.parameters()]
    with memory:
        plan = choose_plan(target, memory, None)
    assert plan.elements == expected and plan.batch_size == batch
    assert plan.peak_bytes == peaks[expected]
    for p, q in zip(before, model.parameters(), strict=True):
        assert torch.equal(p, q)  # the probes left the weights as they were
    assert all(p.grad is None for p in model.parameters())


def test_below_every_plan_at_the_batch_the_rig_halves_it():
    peaks = _peaks(*SHAPES["activations"])
    budget = peaks[("recompute", "offload")] / 0.9 / MiB * 0.97
    target, memory = _worker(budget, *SHAPES["activations"])
    with memory:
        plan = choose_plan(target, memory, None)
    assert plan.elements == ("recompute", "offload") and plan.batch_size < 2048
    assert plan.peak_bytes <= 0.9 * budget * MiB
    assert plan.describe(1).startswith(
        f"rank 1 ({budget:.0f} MiB): batch {plan.batch_size} (of 2048), activation checkpointing, "
        "optimizer state on host; probe peak"
    )


def test_nothing_fits_names_the_need_against_the_budget():
    target, memory = _worker(0.6)  # the parameters alone take 5 MiB
    refusal = (
        r"rank 1: no memory plan fits its device \(1 MiB.*at batch 1 .* needs \d+ MiB "
        r"\(the parameters alone take 5 MiB"
    )
    with memory, pytest.raises(MemoryPlanError, match=refusal):
        choose_plan(target, memory, None)


def test_a_configured_plan_is_taken_as_is_without_a_probe():
    target, memory = _worker(1.0)  # far too small: no probe runs to find out
    plan = choose_plan(target, memory, ("offload",))
    assert plan.elements == ("offload",) and plan.peak_bytes is None
    assert plan.describe(1) == "rank 1 (1 MiB): batch 512, optimizer state on host"


def test_no_budget_no_plan_and_nothing_announced():
    target, _ = _worker(None)
    plan = choose_plan(target, None, None)
    assert plan.elements == () and plan.describe(0) == ""
