"""A rank's device memory: the rig's simulated device (:class:`RankMemory`), the memory plan
(``cluster.memory_plan``) and ``cluster.batch_sizes: auto``.

``cluster.batch_sizes: auto``: the largest batch whose probe step fits in this rank's memory.

Runs on the rank, before training, on its own CUDA device (the launcher refuses ``auto`` for CPU
ranks). A probe step is one forward, backward and optimizer step of the rank's model (its weights
are restored afterwards) with a throwaway optimizer, in the run's precision; it fits when it
neither runs out of memory nor peaks above ``cluster.memory_fraction`` of the device's memory.
Sizes double from 1 while they fit, then the gap to the first misfit is bisected, so a size is
decided in about ``2 log2(size)`` probe steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flodl.config import Mode, TrainerConfig
from flodl.rig.device_memory import DeviceMemory, MiB, training_state
from flodl.runtime.rank.shard_plan import MemoryPlanError, shardable, wrap

log = logging.getLogger(__name__)

_MAX_PROBE = 1 << 16


def _fits(worker: Any, dataset: Any, size: int, budget: float) -> bool:
    """One probe step on the rank's own model with a throwaway optimizer (its state counts)."""
    from flodl.data.source import BatchSource

    device, model = worker.device, worker.model
    optimizer = worker.spec.optim_factory(model.parameters())
    source = BatchSource(dataset, size, worker.cfg.seed, device)
    peak = math.inf
    try:
        torch.cuda.reset_peak_memory_stats(device)
        batch = next(iter(source.batches(0, ((0, size),))))
        with worker.runner.autocast():
            loss = worker.spec.train_step(model, batch)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        torch.cuda.empty_cache()
    return peak <= budget


def probe_batch_size(worker: Any, dataset: Any) -> int:
    """The largest batch size (<= the dataset) whose probe step fits under the memory budget."""
    device = worker.device
    if device.type != "cuda":
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {worker.rank} runs on {device}, where no memory "
            "probe exists; give the sizes instead"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    budget = worker.cfg.cluster.memory_fraction * total
    saved = {k: v.detach().to("cpu", copy=True) for k, v in worker.model.state_dict().items()}
    try:
        return _search(worker, dataset, budget, total)
    finally:  # the probes stepped the model: put back the weights (and BatchNorm statistics)
        worker.model.load_state_dict(saved)


def own_batch_size(worker: Any, dataset: Any) -> int:
    """This rank's batch size: the placement's (``None``: probed here); a memory plan may
    still halve it."""
    size = worker.spec.batch_size_for(worker.rank)
    if size is None:  # cluster.batch_sizes=auto: the largest that fits, probed here
        size = probe_batch_size(worker, dataset)
        log.info(
            "rank %d: batch size %d (probed, memory_fraction %.2f)",
            worker.rank,
            size,
            worker.cfg.cluster.memory_fraction,
        )
    return int(size)


def _search(worker: Any, dataset: Any, budget: float, total: int) -> int:
    limit = min(len(dataset), _MAX_PROBE)
    good, bad = 0, None
    size = 1
    while size <= limit and _fits(worker, dataset, size, budget):
        good, size = size, size * 2
    if size <= limit:
        bad = size
    elif good < limit and _fits(worker, dataset, limit, budget):
        return limit
    else:
        bad = limit if good < limit else None
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if _fits(worker, dataset, mid, budget) else (good, mid)
    if good == 0:
        raise RuntimeError(
            f"cluster.batch_sizes=auto: rank {worker.rank} cannot fit even one sample under "
            f"memory_fraction={worker.cfg.cluster.memory_fraction} of {total / 2**30:.1f} GiB"
        )
    return good


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

PLAN_WORDS = {
    "recompute": "activation checkpointing",
    "offload": "optimizer state on host",
    "shard": "optimizer state sharded",
}
_BOTH = ("recompute", "offload")
_CANDIDATES: tuple[tuple[str, ...], ...] = ((), ("recompute",), ("offload",), _BOTH)


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's plan, as chosen (or configured) and announced."""

    elements: tuple[str, ...] = ()
    batch_size: int = 0
    budget_bytes: int | None = None
    peak_bytes: int | None = None  # the chosen plan's probe peak (None: not probed)
    requested_batch: int = 0
    # shard (flodl/runtime/rank/shard_plan.py): what the rank tells the cohort before the cut
    free_bytes: int | None = None  # device memory free for optimizer state (None: not counted)
    state_bytes: int = 0  # the whole optimizer state's cost on the device (0: not measured)
    share: float | None = None  # the fraction of the state it holds, once cut

    def describe(self, rank: int) -> str:
        """``rank 2 (12.0 GB): batch 8, activation checkpointing, optimizer state on host``;
        empty when there was nothing to plan (no budget, no plan configured)."""
        if not self.budget_bytes and not self.elements:
            return ""
        budget = f" ({_size(self.budget_bytes)})" if self.budget_bytes else ""
        batch = f"batch {self.batch_size}"
        if self.requested_batch and self.requested_batch != self.batch_size:
            batch += f" (of {self.requested_batch})"
        parts = [batch, *(self._words(e) for e in self.elements)] if self.elements else [batch]
        if not self.elements:
            parts.append("no plan needed" if self.peak_bytes is not None else "no plan")
        peak = f"; probe peak {_size(self.peak_bytes)}" if self.peak_bytes is not None else ""
        return f"rank {rank}{budget}: {', '.join(parts)}{peak}"

    def _words(self, element: str) -> str:
        if element == "shard" and self.share is not None:
            return f"{PLAN_WORDS[element]} ({100 * self.share:.0f} % of it)"
        return PLAN_WORDS[element]


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


class _Meter:
    """Peak memory of one probe step: the rig's counted device, or CUDA's allocator."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rig: DeviceMemory | None = worker.memory
        if self.rig is not None:
            assert self.rig.budget is not None
            self.total = self.rig.budget
        else:
            self.total = torch.cuda.get_device_properties(worker.device).total_memory
        self.budget = worker.cfg.cluster.memory_fraction * self.total

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
        device = self.worker.device
        try:
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()


def _probe(worker: Any, meter: _Meter, size: int, plan: tuple[str, ...]) -> int | None:
    """Peak of one step of the rank's model at batch ``size`` under ``plan`` (two micro-batches
    when gradients accumulate)."""
    from flodl.step.plan_elements import HostOptimizer, set_recompute

    model = worker.model
    set_recompute(model, "recompute" in plan)
    source = copy.copy(worker.source)  # its data as placed (resident data counts), cut at size
    source.batch_size = size
    holder: dict[str, Any] = {}

    def step() -> None:
        held = _gradient_buckets(worker)
        if "offload" in plan or "shard" in plan:  # shard: the step without the state
            holder["opt"] = HostOptimizer(
                model.parameters(), worker.spec.optim_factory, host=meter.host
            )
        else:
            holder["opt"] = worker.spec.optim_factory(model.parameters())
        # With accumulation a second micro-batch's gradients are added to the first's: the
        # new ones and the sum coexist for a moment (one more gradient of the largest tensor).
        for _ in range(2 if worker.cfg.accumulate_grad_batches > 1 else 1):
            batch = next(iter(source.batches(0, ((0, size),))))
            with worker.runner.autocast():
                loss = worker.spec.train_step(model, batch)
            loss.backward()
            del loss, batch
        del held  # from here the gradients are the buckets (views), as they are in training
        holder["opt"].step()
        holder["opt"].zero_grad(set_to_none=True)
        _averaging_temporaries(worker)

    try:
        return meter.peak_of(step)
    finally:
        opt = holder.pop("opt", None)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.grad = None
        del opt


def _gradient_buckets(worker: Any) -> torch.Tensor | None:
    """nccl_sync over several ranks: the gradient all-reduce's buckets, kept across steps
    (flodl/runtime/sync/gradsync.py), so they are there while the next backward makes new
    gradients: as large as the trainable parameters, held through the probe's backward (in
    the optimizer step the gradients are views of them: counted once, as gradients)."""
    if worker.mode is not Mode.NCCL_SYNC or worker.world <= 1:
        return None
    nbytes = sum(p.numel() * p.element_size() for p in worker.model.parameters() if p.requires_grad)
    return torch.empty(nbytes, dtype=torch.uint8, device=worker.device)


def _averaging_temporaries(worker: Any) -> None:
    """Allocate what averaging holds between steps, as it does (no collective): the scaled
    copy of the state and the divergence's span; in the controller's modes and with compression
    a second copy (the snapshot sent, the average received; the compressor's reference)."""
    if worker.world <= 1:
        return
    state = worker.state
    held = [state.flatten()]
    if worker.mode.via_controller or worker.compressor is not None:
        held.append(state.flatten())
    state.divergence(state.current(), held[0])
    del held


def choose_plan(
    worker: Any, requested: tuple[str, ...] | None, may_shard: bool = False
) -> MemoryPlan:
    """The rank's plan: ``requested`` as configured (None: ``auto``, probed where a budget
    exists). ``may_shard``: the cohort may shard its optimizer state (nccl_sync), so ``auto``
    tries ``shard`` before ``offload``, and the plan carries what the cut needs (the memory
    free for optimizer state, the state's cost). The model's weights and buffers are as they
    were afterwards."""
    size = worker.batch_size
    rig = worker.memory
    has_budget = rig is not None or worker.device.type == "cuda"
    if not has_budget or (requested is not None and not (may_shard and "offload" not in requested)):
        budget = rig.budget if rig is not None else None
        return MemoryPlan(requested or (), size, budget, None, size)
    meter = _Meter(worker)
    with meter.host():  # the weights, put back afterwards, wait in host memory
        saved = {k: v.detach().to("cpu", copy=True) for k, v in worker.model.state_dict().items()}
    try:
        if requested is not None:  # may shard: measure what the cut needs
            plan = MemoryPlan(requested, size, int(meter.total), None, size)
            return _with_shard_numbers(worker, meter, plan, {})
        return _choose(worker, meter, size, may_shard)
    finally:
        from flodl.step.plan_elements import set_recompute

        set_recompute(worker.model, True)
        with torch.no_grad():
            worker.model.load_state_dict(saved)
        if worker.device.type == "cuda":  # training's peak is its own, not the probes'
            torch.cuda.reset_peak_memory_stats(worker.device)


def _with_shard(plan: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(e for e in ("recompute", "offload", "shard") if e in plan or e == "shard")


def _with_shard_numbers(
    worker: Any, meter: _Meter, plan: MemoryPlan, peaks: dict[tuple[str, ...], int | None]
) -> MemoryPlan:
    """``plan`` with the memory it leaves free for optimizer state (its step without the
    state) and the whole state's cost (its step with it, less without)."""
    from flodl.step.plan_elements import recompute

    if "offload" in plan.elements:  # its state is on the host: it holds no share
        return dataclasses.replace(plan, free_bytes=0, state_bytes=0)
    recompute(worker.model)  # patched once, switched per probe
    base = tuple(e for e in plan.elements if e != "shard")
    for p in (base, _with_shard(base)):
        if p not in peaks:
            peaks[p] = _probe(worker, meter, plan.batch_size, p)
    full, stateless = peaks[base], peaks[_with_shard(base)]
    if stateless is None:  # CUDA ran out of memory even without the state
        return dataclasses.replace(plan, free_bytes=0, state_bytes=0)
    state = max((full if full is not None else stateless) - stateless, 0)
    return dataclasses.replace(plan, free_bytes=int(meter.budget) - stateless, state_bytes=state)


def _choose(worker: Any, meter: _Meter, size: int, may_shard: bool = False) -> MemoryPlan:
    from flodl.step.plan_elements import recompute

    recompute(worker.model)  # patched once, switched per probe
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
    first = _CANDIDATES
    if may_shard:
        first = ((), ("recompute",), ("shard",), ("recompute", "shard"), *_CANDIDATES[2:])
    peaks: dict[tuple[str, ...], int | None] = {}
    last_peak: int | None = None
    for b in batches:
        for plan in first if b == size else (_BOTH,):
            peak = _probe(worker, meter, b, plan)
            if b == size:
                peaks[plan] = peak
            last_peak = peak
            if peak is not None and peak <= meter.budget:
                chosen = MemoryPlan(plan, b, total, peak, size)
                if may_shard and b == size:
                    chosen = _with_shard_numbers(worker, meter, chosen, peaks)
                elif may_shard:
                    chosen = dataclasses.replace(chosen, free_bytes=0)
                return chosen
    state = sum(t.numel() * t.element_size() for t in worker.model.parameters())
    needs = f"needs {_size(last_peak)}" if last_peak is not None else "runs out of memory"
    raise MemoryPlanError(
        f"rank {worker.rank}: no memory plan fits its device ({_size(total)}, memory_fraction "
        f"{worker.cfg.cluster.memory_fraction}): a step at batch {batches[-1]} with activation "
        f"checkpointing and optimizer state on host {needs} (the parameters alone take "
        f"{_size(state)}, their gradients as much); give the rank more memory or train a "
        "smaller model"
    )


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

    def plan(self, worker: Any) -> MemoryPlan:
        """``cluster.memory_plan``: choose (auto: probe) and apply this rank's plan to
        ``worker`` (its model, batch size and optimizer); announced by the controller from
        Ready."""
        from flodl.config.cluster import parse_memory_plan
        from flodl.step.plan_elements import recompute, set_recompute

        requested = parse_memory_plan(self.cfg.cluster.rank_memory_plan(self.rank))
        cohort_may_shard = shardable(worker)
        plan = choose_plan(worker, requested, cohort_may_shard)
        worker.batch_size = worker.source.batch_size = plan.batch_size
        if "recompute" in plan.elements:
            recompute(worker.model)
        else:
            set_recompute(worker.model, False)
        if "offload" in plan.elements:
            del worker.optimizer
            worker.optimizer = self.host_optimizer(worker)
        if cohort_may_shard:  # whole until the cohort cuts (after the group met)
            worker.optimizer = wrap(worker)
        return plan

    def host_optimizer(self, worker: Any) -> Any:
        """The optimizer stepping on host copies (``offload``), its traffic charged on the rig."""
        from flodl.step.plan_elements import HostOptimizer

        host = self.rig.host if self.rig is not None else contextlib.nullcontext
        charge = self._charge_offload if self.paced else None
        state = worker.state
        return HostOptimizer(
            worker.model.parameters(),
            worker.spec.optim_factory,
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
