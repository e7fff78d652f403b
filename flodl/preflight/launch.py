"""What the launcher checks once the topology is known, before any rank (every run, the Python
API included; a refusal is a :class:`ConfigError`, exit code 2).

:func:`check_config` (no factory: what a sweep refuses before any job) checks precision and
per-rank batch sizes against the ranks' devices, the callback rank and a writable ``save_path``
(:func:`check_outputs`). :func:`check_run` checks the callback rank, a
writable ``save_path`` and the resume bundle (exists, intact, same architecture, epochs left);
:func:`launch_signature` dry-builds the Python API's closures for that comparison
(:mod:`.dry_build`). :func:`check_launch` announces the LR scaling with real numbers and warns
about a per-step scheduler under ``interval=epoch``: the optimizer and scheduler factories are
built on one CPU parameter (a factory that needs the model's own parameter groups is left to
the ranks, which report its errors). torch is imported only by the checks that build.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flodl.config import ConfigError, LoaderConfig, LoaderOverride, Mode, TrainerConfig
from flodl.config.extras import check_extras
from flodl.placement.batches import place_batches, rank_devices
from flodl.placement.topology import Topology

if TYPE_CHECKING:
    import torch

    from flodl.runtime.wire.job_spec import JobSpec

log = logging.getLogger("flodl")


def launch_signature(spec: JobSpec, run_info: dict[str, Any]) -> str | None:
    """The architecture signature: a Hydra job's (its targets were dry-built when its config
    was checked) or, for the Python API, its closures' dry build, which refuses a factory that
    fails before any rank starts."""
    if "model_signature" in run_info:
        signature: str | None = run_info.pop("model_signature")
        return signature
    from flodl.preflight.dry_build import dry_build_closures

    return dry_build_closures(spec)


def _dry_optimizer(spec: JobSpec) -> torch.optim.Optimizer | None:
    import torch

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
    from flodl.step import schedules

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


def check_precision(precision: str, devices: list[str]) -> None:
    cpu = [r for r, d in enumerate(devices) if d != "cuda"]
    if precision == "16-mixed" and cpu:
        raise ConfigError(
            f"trainer.precision=16-mixed: rank(s) {cpu} run on CPU, where fp16 autocast with a "
            "GradScaler is not supported; use trainer.precision=bf16-mixed (CPU and CUDA) or 32"
        )


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
    from flodl.placement.topology import resolve_topology

    check_extras(config.cluster.kind, config.logger.progress)
    topology = resolve_topology(config, probe_hosts=False)
    check_precision(config.precision, rank_devices(topology, config.device))
    place_batches(topology, config)  # its refusals
    rank_loaders(config, topology)
    check_outputs(config, topology.world_size)


def check_launch(spec: JobSpec, topology: Topology) -> dict[str, Any]:
    """Run the launch-time checks (a refusal is a :class:`ConfigError`, before any rank).
    Returns the LR scaling, which the job announces and records in summary.json."""
    from flodl.preflight.dry_build import without_dynamo_import
    from flodl.preflight.footprint import check_memory

    check_precision(spec.config.precision, rank_devices(topology, spec.config.device))
    with without_dynamo_import():  # the launcher trains nothing: torch._dynamo costs 1-3 s
        check_memory(spec, topology.world_size)
        optimizer = _dry_optimizer(spec)
        base = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
        _check_scheduler(spec, optimizer)
    return lr_scaling(base, spec.config.lr_scale_ratio, topology.world_size)


def check_run(cfg: TrainerConfig, world_size: int, signature: str | None = None) -> Any:
    """Extras, callback rank, save location and resume bundle; returns the loaded resume
    point."""
    check_extras(cfg.cluster.kind, cfg.logger.progress)
    check_outputs(cfg, world_size)
    return _resume(cfg, world_size, signature) if cfg.resume_from is not None else None


def check_outputs(cfg: TrainerConfig, world_size: int) -> None:
    """The callback rank inside the cohort; a writable ``save_path`` (a probe file is created
    and deleted)."""
    policy = cfg.callback_policy
    if policy.kind == "rank" and policy.rank >= world_size:
        raise ConfigError(
            f"trainer.callback_policy.rank={policy.rank}: this run has {world_size} rank(s) "
            f"(0..{world_size - 1}); pick one of them or callback_policy.kind=fastest"
        )
    check_ports(cfg)
    if cfg.save_path is not None:
        from flodl.checkpoint.bundle import CheckpointError, probe_writable

        try:
            probe_writable(cfg.save_path)
        except CheckpointError as exc:
            raise ConfigError(
                f"trainer.save_path={cfg.save_path}: {exc}; choose a writable location"
            ) from None


def _resume(cfg: TrainerConfig, world_size: int, signature: str | None) -> Any:
    from flodl.checkpoint.bundle import CheckpointError
    from flodl.runtime.controller.snapshots import ResumePoint

    stem = cfg.resume_from
    assert stem is not None
    key = f"trainer.resume_from={stem}"
    try:
        point = ResumePoint.load(stem, fallback=cfg.resume_fallback)
    except CheckpointError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    meta = point.meta
    if meta.world_size != world_size:  # any world size resumes (README: Checkpoints)
        logging.getLogger(__name__).info(
            "%s: saved by %d ranks, resuming on %d", key, meta.world_size, world_size
        )
    if signature is not None and meta.signature and meta.signature != signature:
        raise ConfigError(
            f"{key}: saved for another model (architecture {meta.signature} != {signature}); "
            "point it at a bundle of this model"
        )
    if meta.epoch >= cfg.num_epochs:
        raise ConfigError(
            f"{key}: the bundle already finished {meta.epoch} epochs; trainer.num_epochs="
            f"{cfg.num_epochs} leaves nothing to train (raise it)"
        )
    return point


def check_ports(cfg: TrainerConfig) -> None:
    """A fixed ``cluster.controller.port`` and the store's (port + 1) are free on the
    controller's address: bound and closed again here, so a taken one is refused before any
    rank starts (was: exit 1, "[Errno 98] Address already in use", naming neither)."""
    import errno
    import socket

    address = cfg.cluster.controller
    if not address.port:
        return
    ports = ((address.port, "the control plane's"), (address.port + 1, "the store's: port + 1"))
    for port, what in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener binds
            try:
                sock.bind((address.host, port))
                sock.listen(1)  # as the listener: a port another socket listens on is taken
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    return  # not an address of this machine, say: left to the launch itself
                raise ConfigError(
                    f"cluster.controller.port={address.port}: port {port} on {address.host} "
                    f"({what}) is in use; choose a free port, or 0 for any free one"
                ) from None
