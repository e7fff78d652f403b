"""Launch-time checks and notices of the training features, in the launcher, before any rank.

The optimizer and scheduler factories are dry-built on one CPU parameter (never CUDA, never the
model), so the LR scaling can be announced with real numbers and a per-step scheduler under
``interval=epoch`` is warned about before anything trains. A factory that cannot be built that way
(it needs the model's own parameter groups) is left to the ranks, which report its errors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flodl import schedules
from flodl.config import ConfigError, LoaderConfig, LoaderOverride, Mode, TrainerConfig
from flodl.runtime.spec import JobSpec
from flodl.topology import Topology

log = logging.getLogger("flodl")


def _dry_optimizer(spec: JobSpec) -> torch.optim.Optimizer | None:
    try:
        optimizer = spec.optim_factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception:  # a factory that needs the real model: announce the factor only
        return None
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def lr_scaling(base_lr: float | None, ratio: float, world: int) -> dict[str, Any]:
    """The linear scaling rule's numbers: ``lr x (1 + (world - 1) x ratio)``."""
    factor = 1.0 + (world - 1) * ratio
    return {
        "base_lr": base_lr,
        "factor": factor,
        "lr_scale_ratio": ratio,
        "world_size": world,
        "lr": base_lr * factor if base_lr is not None else None,
    }


def _num(x: float) -> str:
    text = f"{x:.6g}"
    return text if any(c in text for c in ".en") else f"{text}.0"


def format_lr_scaling(record: dict[str, Any]) -> str:
    """``lr 0.05 \u00d7 2.0 (lr_scale_ratio 1.0, 2 ranks) = 0.1``."""
    ranks = f"{record['world_size']} rank{'s' if record['world_size'] != 1 else ''}"
    why = f"(lr_scale_ratio {_num(record['lr_scale_ratio'])}, {ranks})"
    if record["base_lr"] is None:
        return f"lr \u00d7 {_num(record['factor'])} {why}"
    return (
        f"lr {_num(record['base_lr'])} \u00d7 {_num(record['factor'])} {why} = {_num(record['lr'])}"
    )


def _check_scheduler(spec: JobSpec, optimizer: torch.optim.Optimizer | None) -> None:
    if spec.scheduler_factory is None or optimizer is None:
        return
    try:
        scheduler = schedules.build(spec.scheduler_factory, optimizer, 1000)
    except Exception as exc:  # it may need the model's own parameter groups: ranks will tell
        log.debug("scheduler dry build skipped (%s: %s)", type(exc).__name__, exc)
        return
    if spec.scheduler_interval == "epoch" and schedules.is_per_step(scheduler):
        log.warning(
            "scheduler %s is meant to advance per optimizer step, but scheduler.interval=epoch "
            "steps it once per epoch (%d times in this run): set scheduler.interval=step",
            type(scheduler).__name__,
            spec.config.num_epochs,
        )


def rank_devices(topology: Topology, device: str) -> list[str]:
    """``cpu`` or ``cuda`` for each rank, decided without touching CUDA."""
    if topology.in_process:
        if device == "auto":
            from flodl.sys import detect_gpus

            device = "cuda" if detect_gpus() else "cpu"
        return [device]
    return [p.device for p in topology.placements] or ["cpu"] * topology.world_size


def check_precision(precision: str, devices: list[str]) -> None:
    cpu = [r for r, d in enumerate(devices) if d != "cuda"]
    if precision == "16-mixed" and cpu:
        raise ConfigError(
            f"trainer.precision=16-mixed: rank(s) {cpu} run on CPU, where fp16 autocast with a "
            "GradScaler is not supported; use trainer.precision=bf16-mixed (CPU and CUDA) or 32"
        )


def rank_batch_sizes(config: TrainerConfig, topology: Topology) -> list[int | None]:
    """Each rank's batch size (``None``: probed on the rank, ``auto``), from cluster.batch_sizes,
    a host worker's batch_size, or trainer.batch_size."""
    cluster, world = config.cluster, topology.world_size
    sizes: list[int | str | None]
    if isinstance(cluster.batch_sizes, list):
        solo = config.elche.mode is Mode.SOLO  # rank 0 alone: its size
        if len(cluster.batch_sizes) != world and not solo:
            raise ConfigError(
                f"cluster.batch_sizes={cluster.batch_sizes}: {len(cluster.batch_sizes)} entries "
                f"but the run has {world} rank(s); give one size per rank"
            )
        sizes = list(cluster.batch_sizes[:world])
    elif cluster.kind == "hosts" and topology.placements:
        sizes = [cluster.workers[p.worker or 0].batch_size for p in topology.placements]
    else:
        sizes = [cluster.batch_sizes] * world
    devices = rank_devices(topology, config.device)
    probed = [r for r, b in enumerate(sizes) if b == "auto" and devices[r] != "cuda"]
    if probed:
        raise ConfigError(
            f"cluster.batch_sizes=auto: rank(s) {probed} run on CPU, where no memory probe "
            "exists; give the sizes (cluster.batch_sizes: [64, 16]) or trainer.batch_size"
        )
    return [None if b == "auto" else int(b) if b is not None else config.batch_size for b in sizes]


def rank_loaders(config: TrainerConfig, topology: Topology) -> list[LoaderConfig]:
    """Each rank's loader settings: the ``loader`` node with ``loader.ranks[r]`` (or its host
    worker's ``loader``) applied."""
    base, world = config.loader, topology.world_size
    overrides: list[LoaderOverride | None]
    if base.ranks is not None:
        if len(base.ranks) != world and config.elche.mode is not Mode.SOLO:
            raise ConfigError(
                f"loader.ranks: {len(base.ranks)} entries but the run has {world} rank(s); "
                "give one override per rank ({} inherits the loader node)"
            )
        overrides = list(base.ranks[:world])
    elif config.cluster.kind == "hosts" and topology.placements:
        overrides = [config.cluster.workers[p.worker or 0].loader for p in topology.placements]
    else:
        overrides = [None] * world
    loaders = [base.for_rank(o) for o in overrides]
    for rank, cfg in enumerate(loaders):
        if cfg.prefetch_factor is not None and cfg.num_workers == 0:
            raise ConfigError(
                f"loader.prefetch_factor={cfg.prefetch_factor} (rank {rank}): prefetching needs "
                "worker processes; set loader.num_workers > 0 or prefetch_factor: null"
            )
    return loaders


def check_config(config: TrainerConfig) -> None:
    """The checks that need the topology but no factory: what a sweep refuses before any job
    (hosts are not contacted here)."""
    from flodl.topology import resolve_topology

    topology = resolve_topology(config, probe_hosts=False)
    check_precision(config.precision, rank_devices(topology, config.device))
    rank_batch_sizes(config, topology)
    rank_loaders(config, topology)


def preflight(spec: JobSpec, topology: Topology) -> dict[str, Any]:
    """Run the launch-time checks (a refusal is a :class:`ConfigError`, before any rank).
    Returns the LR scaling, which the job announces and records in summary.json."""
    check_precision(spec.config.precision, rank_devices(topology, spec.config.device))
    optimizer = _dry_optimizer(spec)
    base = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
    _check_scheduler(spec, optimizer)
    return lr_scaling(base, spec.config.lr_scale_ratio, topology.world_size)
