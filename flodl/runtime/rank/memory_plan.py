"""A rank's device memory: the rig's simulated device (:class:`RankMemory`) and the memory plan
(``cluster.memory_plan``), chosen from what the rank's :class:`ProbeTarget` says of it and
returned (the batch size, the optimizer), never written into the rank
(``cluster.batch_sizes: auto`` is :mod:`flodl.runtime.rank.batch_probe`'s).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flodl.config import TrainerConfig, resolve_dotted
from flodl.config.registries.plan_elements import (
    PLAN_ELEMENTS,
    auto_candidates,
    cutting_state,
    elements_of,
    fallback_plan,
    parse_memory_plan,
    with_elements,
    words,
)
from flodl.data.source import BatchSource
from flodl.rig.device_memory import DeviceMemory, MiB, training_state
from flodl.runtime.rank.setup import MemoryPlan, ModelParts, size_text
from flodl.runtime.rank.shard_plan import MemoryPlanError, shardable, wrap
from flodl.runtime.wire.job_spec import JobSpec

log = logging.getLogger(__name__)

# -- memory plans (cluster.memory_plan) ------------------------------------------------------------
#
# A plan is what a rank gives up to fit its device: part of its batch, activations (recomputed in
# backward) or its optimizer state (kept and stepped on the host). ``auto`` decides per rank by
# measurement: probe steps on the rank's own device (CUDA's peak allocation, or the rig's counted
# device memory), each a forward, backward and optimizer step of the real model at the rank's
# batch with a throwaway optimizer (its state counts), the weights put back afterwards. The
# cheapest plan whose probe peaks within ``cluster.memory_fraction`` of the budget is taken:
# nothing, then recomputation (about one more forward pass), then (nccl_sync) a share of the
# optimizer state, alone or with recomputation (a broadcast of the rank's share per step; the
# share is the cohort's to cut: flodl/runtime/rank/shard_plan.py), then offload (host traffic
# and a host optimizer step), then both; on the rig, where ``memory_mb`` makes per-rank batch
# sizes part of the plan, the batch is then halved until a step fits. A rank nothing fits fails,
# naming what it needs against its budget.


@dataclass(frozen=True)
class ProbeTarget:
    """What the memory plan reads of a rank: its job, identity and device, its model, its data
    (as placed, at the batch it asked for), and what averaging will hold between steps."""

    spec: JobSpec
    rank: int
    device: torch.device
    parts: ModelParts
    source: BatchSource
    world: int
    gradient_buckets: bool  # nccl_sync over several ranks: the all-reduce's buckets persist
    second_copy: bool  # the controller's modes or compression hold a second copy of the state

    @property
    def cfg(self) -> TrainerConfig:
        return self.spec.config


# The elements, their words, their costs and what combines: the registry
# (flodl/config/registries/plan_elements.py); each element's rank-side application is an ``apply_*``
# function below, named there.


class _Meter:
    """Peak memory of one probe step: the rig's counted device, or CUDA's allocator."""

    def __init__(self, rig: DeviceMemory | None, device: torch.device, fraction: float) -> None:
        self.device = device
        self.rig = rig
        if self.rig is not None:
            assert self.rig.budget is not None
            self.total = self.rig.budget
        else:
            self.total = torch.cuda.get_device_properties(device).total_memory
        self.budget = fraction * self.total

    def host(self) -> Any:
        return self.rig.host() if self.rig is not None else contextlib.nullcontext()

    def peak_of(self, step: Callable[[], None]) -> int | None:
        """The step's peak in bytes; None when it ran out of memory."""
        if self.rig is not None:
            budget, self.rig.budget = self.rig.budget, None  # measure, never fail: the numbers
            try:
                self.rig.reset_peak()
                step()
                self.rig.sweep()
                return self.rig.peak
            finally:
                self.rig.budget = budget
        device = self.device
        try:
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()


def _probe(target: ProbeTarget, meter: _Meter, size: int, plan: tuple[str, ...]) -> int | None:
    """Peak of one step of the rank's model at batch ``size`` under ``plan`` (two micro-batches
    when gradients accumulate)."""
    from flodl.step.plan_elements import HostOptimizer, set_recompute

    model, spec = target.parts.model, target.spec
    set_recompute(model, any(e.recomputes for e in elements_of(plan)))
    source = copy.copy(target.source)  # its data as placed (resident data counts), cut at size
    source.batch_size = size
    holder: dict[str, Any] = {}

    def step() -> None:
        held = _gradient_buckets(target)
        if any(e.state_off_device for e in elements_of(plan)):  # shard: without the state
            holder["opt"] = HostOptimizer(model.parameters(), spec.optim_factory, host=meter.host)
        else:
            holder["opt"] = spec.optim_factory(model.parameters())
        # With accumulation a second micro-batch's gradients are added to the first's: the
        # new ones and the sum coexist for a moment (one more gradient of the largest tensor).
        for _ in range(2 if target.cfg.accumulate_grad_batches > 1 else 1):
            batch = next(iter(source.batches(0, ((0, size),))))
            with target.parts.runner.autocast():
                loss = spec.train_step(model, batch)
            loss.backward()
            del loss, batch
        del held  # from here the gradients are the buckets (views), as they are in training
        holder["opt"].step()
        holder["opt"].zero_grad(set_to_none=True)
        _averaging_temporaries(target)

    try:
        return meter.peak_of(step)
    finally:
        opt = holder.pop("opt", None)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.grad = None
        del opt


def _gradient_buckets(target: ProbeTarget) -> torch.Tensor | None:
    """nccl_sync over several ranks: the gradient all-reduce's buckets, kept across steps
    (flodl/runtime/sync/gradsync.py), so they are there while the next backward makes new
    gradients: as large as the trainable parameters, held through the probe's backward (in
    the optimizer step the gradients are views of them: counted once, as gradients)."""
    if not target.gradient_buckets:
        return None
    params = target.parts.model.parameters()
    nbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return torch.empty(nbytes, dtype=torch.uint8, device=target.device)


def _averaging_temporaries(target: ProbeTarget) -> None:
    """Allocate what averaging holds between steps, as it does (no collective): the scaled
    copy of the state and the divergence's span; in the controller's modes and with compression
    a second copy (the snapshot sent, the average received; the compressor's reference)."""
    if target.world <= 1:
        return
    state = target.parts.state
    held = [state.flatten()]
    if target.second_copy:
        held.append(state.flatten())
    state.divergence(state.current(), held[0])
    del held


def choose_plan(
    target: ProbeTarget,
    rig: DeviceMemory | None,
    requested: tuple[str, ...] | None,
    may_shard: bool = False,
) -> MemoryPlan:
    """The rank's plan: ``requested`` as configured (None: ``auto``, probed where a budget
    exists). ``may_shard``: the cohort may shard its optimizer state (nccl_sync), so ``auto``
    tries ``shard`` before ``offload``, and the plan carries what the cut needs (the memory
    free for optimizer state, the state's cost). The model's weights and buffers are as they
    were afterwards."""
    size = target.source.batch_size
    model, device = target.parts.model, target.device
    has_budget = rig is not None or device.type == "cuda"
    on_host = requested is not None and any("state" in e.to_host for e in elements_of(requested))
    if not has_budget or (requested is not None and not (may_shard and not on_host)):
        budget = rig.budget if rig is not None else None
        return MemoryPlan(requested or (), size, budget, None, size)
    meter = _Meter(rig, device, target.cfg.cluster.memory_fraction)
    with meter.host():  # the weights, put back afterwards, wait in host memory
        saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    try:
        if requested is not None:  # may shard: measure what the cut needs
            plan = MemoryPlan(requested, size, int(meter.total), None, size)
            return _with_shard_numbers(target, meter, plan, {})
        return _choose(target, meter, size, may_shard)
    finally:
        from flodl.step.plan_elements import set_recompute

        set_recompute(model, True)
        with torch.no_grad():
            model.load_state_dict(saved)
        if device.type == "cuda":  # training's peak is its own, not the probes'
            torch.cuda.reset_peak_memory_stats(device)


def _with_shard(plan: tuple[str, ...]) -> tuple[str, ...]:
    return with_elements(plan, add=cutting_state())


def _with_shard_numbers(
    target: ProbeTarget,
    meter: _Meter,
    plan: MemoryPlan,
    peaks: dict[tuple[str, ...], int | None],
) -> MemoryPlan:
    """``plan`` with the memory it leaves free for optimizer state (its step without the
    state) and the whole state's cost (its step with it, less without)."""
    from flodl.step.plan_elements import recompute

    if plan.state_on_host:  # it holds no share
        return dataclasses.replace(plan, free_bytes=0, state_bytes=0)
    recompute(target.parts.model)  # patched once, switched per probe
    base = with_elements(plan.elements, drop=cutting_state())
    for p in (base, _with_shard(base)):
        if p not in peaks:
            peaks[p] = _probe(target, meter, plan.batch_size, p)
    full, stateless = peaks[base], peaks[_with_shard(base)]
    if stateless is None:  # CUDA ran out of memory even without the state
        return dataclasses.replace(plan, free_bytes=0, state_bytes=0)
    state = max((full if full is not None else stateless) - stateless, 0)
    return dataclasses.replace(plan, free_bytes=int(meter.budget) - stateless, state_bytes=state)


def _choose(target: ProbeTarget, meter: _Meter, size: int, may_shard: bool = False) -> MemoryPlan:
    from flodl.step.plan_elements import recompute

    recompute(target.parts.model)  # patched once, switched per probe
    total = int(meter.total)
    # Smaller batches only where memory_mb makes them part of the plan (the rig); on CUDA the
    # batch is the user's (cluster.batch_sizes=auto probes it).
    batches = [size]
    if meter.rig is not None:
        while batches[-1] > 1:
            batches.append(max(1, batches[-1] // 2))
    # shard before offload: a share of the state on the device steps faster than all of it on
    # the host (whether the share fits is the cohort's decision: the plan falls back to
    # offload when it does not)
    first = auto_candidates(cohort=may_shard)
    fallback = fallback_plan()  # at smaller batches: the most a rank gives up alone
    peaks: dict[tuple[str, ...], int | None] = {}
    last_peak: int | None = None
    for b in batches:
        for plan in first if b == size else [fallback]:
            peak = _probe(target, meter, b, plan)
            if b == size:
                peaks[plan] = peak
            last_peak = peak
            if peak is not None and peak <= meter.budget:
                chosen = MemoryPlan(plan, b, total, peak, size)
                if may_shard and b == size:
                    chosen = _with_shard_numbers(target, meter, chosen, peaks)
                elif may_shard:
                    chosen = dataclasses.replace(chosen, free_bytes=0)
                return chosen
    state = sum(t.numel() * t.element_size() for t in target.parts.model.parameters())
    needs = f"needs {size_text(last_peak)}" if last_peak is not None else "runs out of memory"
    raise MemoryPlanError(
        f"rank {target.rank}: no memory plan fits its device ({size_text(total)}, memory_fraction "
        f"{target.cfg.cluster.memory_fraction}): a step at batch {batches[-1]} with "
        f"{words(fallback)} {needs} (the parameters alone take "
        f"{size_text(state)}, their gradients as much); give the rank more memory or train a "
        "smaller model"
    )


# -- each element applied on a rank (named by its entry in config/registries/plan_elements.py) -
def apply_recompute(
    memory: RankMemory,
    target: ProbeTarget,
    optimizer: torch.optim.Optimizer,
    chosen: bool,
    cohort: bool,
) -> torch.optim.Optimizer:
    """Activations recomputed in backward, or not (the probes patched the model's blocks)."""
    from flodl.step.plan_elements import recompute, set_recompute

    if chosen:
        recompute(target.parts.model)
    else:
        set_recompute(target.parts.model, False)
    return optimizer


def apply_offload(
    memory: RankMemory,
    target: ProbeTarget,
    optimizer: torch.optim.Optimizer,
    chosen: bool,
    cohort: bool,
) -> torch.optim.Optimizer:
    """The optimizer replaced by one stepping on host copies."""
    return memory.host_optimizer(target.spec, target.parts) if chosen else optimizer


def apply_shard(
    memory: RankMemory,
    target: ProbeTarget,
    optimizer: torch.optim.Optimizer,
    chosen: bool,
    cohort: bool,
) -> torch.optim.Optimizer:
    """A cohort that may shard: the optimizer wrapped, whole until the cohort cuts (after the
    group met: flodl/runtime/rank/shard_plan.py), whether this rank asked or ``auto`` may."""
    if not cohort:
        return optimizer
    return wrap(optimizer, target.spec.optim_factory, target.parts.state)


# -- the rank's memory -----------------------------------------------------------------------------
class RankMemory:
    """One rank's device memory: on the CPU rig with ``cluster.memory_mb``, the simulated device
    its allocations count against (:attr:`rig`); the plan that makes the rank fit; its peak."""

    def __init__(
        self, cfg: TrainerConfig, rank: int, device: torch.device, pacer: Any, paced: bool
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.pacer = pacer
        self.paced = paced  # the CPU rig paces its ranks: its memory and offload are simulated
        self.rig: DeviceMemory | None = None  # cluster.memory_mb on the rig (built later)

    def simulate(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """CPU rig with ``cluster.memory_mb``: from here on the rank's allocations count against
        its simulated device (flodl/rig/device_memory.py); past it, torch.OutOfMemoryError."""
        budget = self.cfg.cluster.rank_memory_mb(self.rank) if self.paced else None
        if budget is None or self.device.type != "cpu":
            return
        self.rig = DeviceMemory(int(budget * MiB), name=f"rank {self.rank}")
        self.rig.adopt(training_state(model, optimizer))
        self.rig.__enter__()

    def place(self, source: Any, loader_cfg: Any) -> None:
        """The rig's simulated device: a dataset already in memory (tensors) is resident on it
        as ``loader.placement`` decides on a GPU (``auto``: when it fits ``resident_fraction``
        of the free budget), and then counts; otherwise it stays in host memory and only the
        batches cut from it count."""
        from torch.utils._pytree import tree_leaves

        from flodl.data.residency import tree_bytes

        tree = getattr(source, "_tree", None)
        if self.rig is None or self.rig.budget is None or tree is None:
            return
        need = tree_bytes(tree)
        self.rig.sweep()
        free = self.rig.budget - self.rig.current
        placement = loader_cfg.placement
        if placement == "resident" or (
            placement == "auto" and need <= loader_cfg.resident_fraction * free
        ):
            self.rig.adopt(tensors for tensors in tree_leaves(tree))
            log.info(
                "rank %d: dataset resident on the rig's device (%.1f MiB)", self.rank, need / MiB
            )

    def plan(
        self, target: ProbeTarget, optimizer: torch.optim.Optimizer
    ) -> tuple[MemoryPlan, torch.optim.Optimizer]:
        """``cluster.memory_plan``: this rank's plan, chosen (auto: probed) and applied to its
        model and ``optimizer``; the plan (its batch size too) and the optimizer to train with.
        Announced by the controller from Ready."""
        requested = parse_memory_plan(self.cfg.cluster.rank_memory_plan(self.rank))
        cohort_may_shard = shardable(target.spec, optimizer)
        plan = choose_plan(target, self.rig, requested, cohort_may_shard)
        for element in PLAN_ELEMENTS.values():  # in the registry's order
            apply: Callable[..., torch.optim.Optimizer] = resolve_dotted(element.rank_side)
            optimizer = apply(
                self, target, optimizer, element.name in plan.elements, cohort_may_shard
            )
        return plan, optimizer

    def host_optimizer(self, spec: JobSpec, parts: ModelParts) -> torch.optim.Optimizer:
        """The optimizer stepping on host copies (``offload``), its traffic charged on the rig."""
        from flodl.step.plan_elements import HostOptimizer

        host = self.rig.host if self.rig is not None else contextlib.nullcontext
        charge = self._charge_offload if self.paced else None
        state = parts.state
        return HostOptimizer(
            parts.model.parameters(),
            spec.optim_factory,
            host=host,
            charge=charge,
            watch=lambda: [state.shared()],  # averages land through the flat buffer
        )

    def _charge_offload(self, moved: int, stepped: int) -> None:
        """The rig: an offloaded step's host traffic and host step, in simulated time."""
        from flodl.rig.device_memory import offload_step_s

        self.pacer.charge(offload_step_s(moved, stepped))

    def unplanned(self, model: torch.nn.Module) -> Any:
        """Steps as the device runs them without a plan (calibration's nominal step): nothing
        recomputed, nothing counted against the rig's memory (a measurement, not training)."""
        from flodl.step.plan_elements import recompute_off

        stack = contextlib.ExitStack()
        stack.enter_context(recompute_off(model))
        if self.rig is not None:
            stack.enter_context(self.rig.host())
        return stack

    def host(self) -> Any:
        """Allocations in host memory, not counted against the rig's device."""
        return self.rig.host() if self.rig is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.rig is not None:
            self.rig.__exit__(None, None, None)
            self.rig = None

    def peak(self) -> int:
        """Peak device memory in bytes: CUDA's max allocated, the rig's simulated device's,
        else this process's peak RSS."""
        if self.rig is not None:
            return self.rig.peak
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
