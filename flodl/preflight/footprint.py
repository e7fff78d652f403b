"""Memory plans that cannot fit, refused at launch with the numbers (``cluster.memory_mb``).

The model and one optimizer step are built on the ``meta`` device (shapes, no memory) to size the
training state: parameters, their gradients, the optimizer's state. No plan takes the parameters
and their gradients off a device, so a rank whose budget is smaller than both is refused; an
explicit plan without ``offload`` also needs the optimizer state on the device, and an explicit
``shard`` needs it in the cohort's memory beyond parameters and gradients. Plans that put
optimizer state on the host need it in host memory, one copy (and the parameters' host copy) per
offloading rank. Activations depend on data and are the ranks' to measure (their probe steps).
A factory that cannot build on ``meta`` leaves every check to the ranks.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from typing import Any

from flodl.config import ConfigError
from flodl.config.cluster import parse_memory_plan

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
        floor = need.params + need.grads
        if floor > budget:
            raise ConfigError(
                f"cluster.memory_mb: rank {rank} needs >= {_size(floor)} for parameters and "
                f"gradients at batch 1 (no memory plan moves them off the device); its budget "
                f"is {_size(budget)}. Give it more memory, or train a smaller model"
            )
        offloads = plan is None or "offload" in plan
        if plan is not None and "shard" in plan:
            continue  # a share of the state: the cohort's check below
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
    """An explicit ``shard``: the cohort's memory beyond parameters and gradients must hold the
    optimizer state (a lower bound: the ranks' probes add activations, and refuse at start)."""
    if not cluster.plans_shard() or need.optimizer is None:
        return
    floor = need.params + need.grads
    room = [(r, (cluster.rank_memory_mb(r) or 0) * MiB - floor) for r in range(world)]
    if any(cluster.rank_memory_mb(r) is None for r in range(world)):
        return  # a rank without a budget: the ranks decide
    total = sum(max(free, 0) for _, free in room)
    if need.optimizer > total:
        each = ", ".join(f"rank {r}: {_size(max(free, 0))}" for r, free in room)
        raise ConfigError(
            f"cluster.memory_plan={cluster.memory_plan}: the optimizer state "
            f"({_size(need.optimizer)}) does not fit the ranks' memory beyond parameters and "
            f"gradients ({each}; {_size(total)} in all) even sharded; use memory_plan=offload "
            "(state on the host), or give the ranks more memory"
        )


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
