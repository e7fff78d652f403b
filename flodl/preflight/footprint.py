"""Memory plans that cannot fit, refused at launch with the numbers (``cluster.memory_mb``).

The model and one optimizer step are built on the ``meta`` device (shapes, no memory) to size the
training state: parameters, their gradients, the optimizer's state. What each plan element does
to them is its footprint rule in the registry (flodl/config/registries/plan_elements.py: the
parts it keeps on the host, those it divides across the cohort). A rank whose budget is smaller
than the parts its plan leaves whole on the device (parameters and gradients: no element moves
them today) is refused; an explicit plan that keeps the optimizer state on the device needs it
there too, and one that divides parts across the cohort (``shard``) needs them in the cohort's
memory beyond what stays whole. Plans that put optimizer state on the host need it in host
memory, one copy (and the parameters' host copy) per offloading rank. Activations depend on data
and are the ranks' to measure (their probe steps). A factory that cannot build on ``meta``
leaves every check to the ranks.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from typing import Any

from flodl.config import ConfigError
from flodl.config.registries.plan_elements import PLAN_ELEMENTS, elements_of, parse_memory_plan

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class Footprint:
    """Bytes of a model's training state."""

    params: int
    grads: int
    optimizer: int | None  # None: the optimizer did not step on meta


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def footprint(spec: Any) -> Footprint | None:
    """The training state of ``spec``'s model and optimizer, sized on ``meta``."""
    import torch

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            with torch.device("meta"):
                model = spec.model_factory(torch.device("meta"))
            params = [p for p in model.parameters()]
        except Exception as exc:  # the ranks build it (and measure it)
            log.debug("memory check: the model does not build on meta (%s)", exc)
            return None
        trainable = [p for p in params if p.requires_grad]
        total = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.numel() * p.element_size() for p in trainable)
        try:
            optimizer = spec.optim_factory(model.parameters())
            for p in trainable:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            state = sum(
                v.numel() * v.element_size()
                for s in optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.device.type == "meta"
            )
        except Exception as exc:
            log.debug("memory check: the optimizer does not step on meta (%s)", exc)
            state = None
    return Footprint(total, grads, state)


def check_memory(spec: Any, world: int) -> None:
    """Refuse (:class:`ConfigError`, exit 2) a rank whose plan cannot fit its budget."""
    cluster = spec.config.cluster
    if cluster.memory_mb is None:
        return
    need = footprint(spec)
    if need is None:
        return
    host_need = 0
    for rank in range(world):
        budget_mb = cluster.rank_memory_mb(rank)
        plan = parse_memory_plan(cluster.rank_memory_plan(rank))
        if budget_mb is None or plan == ():
            continue  # no plan: a rank that does not fit fails out of memory, as under DDP
        budget = budget_mb * MiB
        elements = elements_of(plan or ())
        divided = {part for e in elements for part in e.divides}
        floor = _whole(need, divided)
        if floor > budget:
            raise ConfigError(
                f"cluster.memory_mb: rank {rank} needs >= {_size(floor)} for parameters and "
                f"gradients at batch 1 (no memory plan moves them off the device); its budget "
                f"is {_size(budget)}. Give it more memory, or train a smaller model"
            )
        # auto may put the state on the host; an element may keep it there
        offloads = plan is None or any("state" in e.to_host for e in elements)
        if divided:
            continue  # a share of it: the cohort's check below
        if not offloads and need.optimizer is not None and floor + need.optimizer > budget:
            raise ConfigError(
                f"cluster.memory_plan={cluster.rank_memory_plan(rank)}: rank {rank} needs >= "
                f"{_size(floor + need.optimizer)} for parameters, gradients and optimizer state; "
                f"its budget is {_size(budget)}. Add offload to its plan, or use auto"
            )
        if offloads and need.optimizer is not None and floor + need.optimizer > budget:
            host_need += need.params + need.optimizer  # auto will offload: the host holds it
    _check_host(host_need)
    _check_shard(cluster, world, need)


def _check_shard(cluster: Any, world: int, need: Footprint) -> None:
    """An explicit cohort element (``shard``): the cohort's memory beyond what each rank holds
    whole must hold what it divides (a lower bound: the ranks' probes add activations, and
    refuse at start)."""
    if not cluster.plans_cohort() or need.optimizer is None:
        return
    divided = _planned_divides(cluster)
    floor = _whole(need, divided)
    room = [(r, (cluster.rank_memory_mb(r) or 0) * MiB - floor) for r in range(world)]
    if any(cluster.rank_memory_mb(r) is None for r in range(world)):
        return  # a rank without a budget: the ranks decide
    total = sum(max(free, 0) for _, free in room)
    sizes = {"params": need.params, "grads": need.grads, "state": need.optimizer}
    cut = sum(sizes[part] for part in divided)
    if cut > total:
        what = "the optimizer state" if divided == {"state"} else "the training state it divides"
        beyond = "parameters and gradients" if floor else "nothing"
        each = ", ".join(f"rank {r}: {_size(max(free, 0))}" for r, free in room)
        raise ConfigError(
            f"cluster.memory_plan={cluster.memory_plan}: {what} "
            f"({_size(cut)}) does not fit the ranks' memory beyond {beyond} "
            f"({each}; {_size(total)} in all) even sharded; use memory_plan=offload "
            "(state on the host), or give the ranks more memory"
        )


def _whole(need: Footprint, divided: set[str]) -> int:
    """The parameters and gradients a rank holds whole: those no element of its plan divides."""
    return (0 if "params" in divided else need.params) + (0 if "grads" in divided else need.grads)


def _planned_divides(cluster: Any) -> set[str]:
    """The parts the explicitly planned elements divide across the cohort."""
    return {p for e in cluster.planned_elements() for p in PLAN_ELEMENTS[e].divides}


def _check_host(host_need: int) -> None:
    if not host_need:
        return
    try:
        import psutil
    except ImportError:
        return
    available = psutil.virtual_memory().available
    if host_need > available:
        raise ConfigError(
            f"cluster.memory_plan: the ranks that must keep their optimizer state on the host "
            f"need {_size(host_need)} of host memory (parameters and state); "
            f"{_size(available)} is available. Train a smaller model or free host memory"
        )
