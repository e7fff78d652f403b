"""Where a run's ranks go: one in-process device, one process per GPU, the CPU rig, the hosts of
a cluster file, a SLURM allocation, or the processes another launcher (torchrun, srun) placed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import EllipsisType

from flodl.config import ClusterConfig, ConfigError, Mode, TrainerConfig, WorkerConfig
from flodl.runtime.wire import rank_env


@dataclass(frozen=True)
class Placement:
    """One global rank: which worker host runs it, on which device, at which simulated speed."""

    rank: int
    host: str = "localhost"
    worker: int | None = None  # index into cluster.workers (None: the launcher's own host)
    device: str = "cpu"  # "cpu" or "cuda"
    gpu: int | None = None  # physical GPU index on its host
    speed: float = 1.0

    @property
    def label(self) -> str:
        """Console prefix: ``rank N`` locally, ``host:N`` on a worker host."""
        return f"rank {self.rank}" if self.worker is None else f"{self.host}:{self.rank}"


@dataclass(frozen=True)
class Topology:
    world_size: int
    backend: str  # "gloo" or "nccl"
    speeds: list[float]
    pace: bool
    in_process: bool
    description: str
    placements: tuple[Placement, ...] = ()
    kind: str = "local"  # local | hosts | slurm | external
    external: rank_env.ExternalRole | None = field(default=None)
    # Each rank's configured batch size (None: probed on the rank); () until
    # flodl.placement.batches.place_batches fills it, the one place it is worked out.
    batch_sizes: tuple[int | None, ...] = ()


def describe_gpus(gpus: list) -> str:
    """The launch banner for GPU ranks, e.g.
    ``ddp: 2 GPUs (heterogeneous) | RTX 5060 Ti (16.0 GB) | GTX 1060 (6.0 GB)``."""
    kinds = {(g.name, g.total_memory_mb) for g in gpus}
    equal = "heterogeneous" if len(kinds) > 1 else "equal"
    devices = " | ".join(f"{g.name} ({g.total_memory_mb / 1024:.1f} GB)" for g in gpus)
    return f"ddp: {len(gpus)} GPUs ({equal}) | {devices}"


def describe_rig(speeds: list[float]) -> str:
    """The launch banner of the CPU rig: each rank's simulated speed and the host's memory."""
    equal = "heterogeneous" if len(set(speeds)) > 1 else "equal"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f", host RAM {ram:.1f} GB shared"
    except (ValueError, OSError, AttributeError):
        memory = ""
    ranks = " | ".join(f"cpu x{s:g}" for s in speeds)
    return f"cpu_rig: {len(speeds)} CPU ranks ({equal}{memory}) | {ranks}"


def _local(world: int, backend: str, speeds: list[float], pace: bool, desc: str) -> Topology:
    device = "cuda" if backend == "nccl" else "cpu"
    places = tuple(Placement(r, device=device, speed=speeds[r]) for r in range(world))
    return Topology(world, backend, speeds, pace, world == 1, desc, places)


def resolve_topology(
    config: TrainerConfig,
    probe_hosts: bool = True,
    placed: rank_env.ExternalRole | EllipsisType | None = ...,
) -> Topology:
    """Decide the cohort from this process's placement and the cluster section.

    ``placed``: what another launcher said of this process, as the entry point read it from the
    environment (:func:`flodl.runtime.wire.rank_env.external_role`); ``...`` reads it here.

    Precedence (as torchrun users expect): ranks placed by another launcher (torchrun / srun
    environment) > ``cluster.kind`` > auto-promote (>= 2 GPUs, probed without touching CUDA) >
    one in-process device. ``hosts`` clusters are checked on their hosts before any rank starts
    (``probe_hosts=False`` skips that, for validation only).
    """
    cluster = config.cluster
    solo = config.elche.mode is Mode.SOLO
    external = rank_env.external_role() if isinstance(placed, EllipsisType) else placed
    if external is not None and rank_env.placed_cohort(external, solo):
        return _external(cluster, external)
    if cluster.kind == "cpu_rig":
        speeds = cluster.rank_speeds()
        pace = cluster.speeds is not None
        if solo or cluster.ranks == 1:
            return _local(1, "gloo", speeds[:1], pace, f"cpu_rig solo speed {speeds[0]}")
        return _local(cluster.ranks, "gloo", speeds, pace, describe_rig(speeds))
    if cluster.kind == "hosts":
        return _hosts(cluster, probe_hosts)
    if cluster.kind == "slurm":
        assert cluster.slurm is not None
        slurm = cluster.slurm
        world = slurm.world_size
        backend = "nccl" if slurm.gpus_per_node else "gloo"
        desc = f"slurm {slurm.nodes} node(s) x {slurm.tasks_per_node} task(s) ({backend})"
        places = tuple(
            Placement(r, host=f"task{r}", worker=r, device="cuda" if slurm.gpus_per_node else "cpu")
            for r in range(world)
        )
        return Topology(world, backend, [1.0] * world, False, False, desc, places, "slurm")
    from flodl.placement.gpus import detect_gpus

    gpus = detect_gpus()
    if len(gpus) >= 2 and not solo:
        places = tuple(
            Placement(
                r, device="cuda", gpu=g.physical_index if g.physical_index is not None else g.index
            )
            for r, g in enumerate(gpus)
        )
        return Topology(
            len(gpus), "nccl", [1.0] * len(gpus), False, False, describe_gpus(gpus), places
        )
    return _local(1, "gloo", [1.0], False, "single device, in-process")


def _external(cluster: ClusterConfig, role: rank_env.ExternalRole) -> Topology:
    """Ranks placed by torchrun / srun: this process is one; rank 0 hosts the controller."""
    placed_by_us = cluster.kind == "slurm" and role.launcher == "submitit"  # controller: rank0
    if cluster.kind in ("hosts", "slurm") and not placed_by_us:
        raise ConfigError(
            f"cluster.kind={cluster.kind}: this process was placed by {role.launcher} "
            f"(RANK={role.rank}, WORLD_SIZE={role.world_size}); use cluster=auto or cpu_rig"
        )
    world = role.world_size
    speeds = [1.0] * world
    pace = False
    if cluster.kind == "cpu_rig" and cluster.speeds is not None:
        if len(cluster.speeds) != world:
            raise ConfigError(
                f"cluster.speeds has {len(cluster.speeds)} entries but {role.launcher} started "
                f"WORLD_SIZE={world} ranks"
            )
        speeds, pace = list(cluster.speeds), True
    backend = "nccl" if role.device == "cuda" else "gloo"
    desc = f"{role.launcher}: {world} ranks ({backend}), this is rank {role.rank}"
    places = tuple(Placement(r, device=role.device, speed=speeds[r]) for r in range(world))
    return Topology(world, backend, speeds, pace, False, desc, places, "external", role)


def _hosts(cluster: ClusterConfig, probe_hosts: bool) -> Topology:
    """Expand the workers into global ranks (worker order), checking each host when asked."""
    from flodl.placement.remote import host_facts_all

    facts = host_facts_all(cluster.workers) if probe_hosts else {}
    places: list[Placement] = []
    for index, worker in enumerate(cluster.workers):
        for device, gpu, speed in worker_devices(index, worker, facts.get(index)):
            places.append(Placement(len(places), worker.host, index, device, gpu, speed))
    kinds = {p.device for p in places}
    if len(kinds) > 1:
        raise ConfigError(
            "cluster.workers mix GPU and CPU ranks: one collective backend serves a cohort "
            "(every worker devices: cpu, or every worker GPUs)"
        )
    backend = "nccl" if kinds == {"cuda"} else "gloo"
    speeds = [p.speed for p in places]
    pace = any(w.speeds is not None for w in cluster.workers)
    hosts = ", ".join(
        f"{w.host} x{sum(p.worker == i for p in places)}" for i, w in enumerate(cluster.workers)
    )
    desc = f"{len(cluster.workers)} host(s) [{hosts}] {len(places)} ranks ({backend})"
    return Topology(len(places), backend, speeds, pace, False, desc, tuple(places), "hosts")


def worker_devices(
    index: int, worker: WorkerConfig, facts: dict | None
) -> list[tuple[str, int | None, float]]:
    key = f"cluster.workers.{index}"
    if worker.devices == "cpu":
        speeds = worker.speeds or [1.0] * worker.ranks
        return [("cpu", None, s) for s in speeds]
    if facts is None:  # not probed: trust the file (validation only)
        gpus = list(range(8)) if worker.devices == "all" else list(worker.devices)
        return [("cuda", g, 1.0) for g in gpus]
    present = [int(g) for g in facts.get("gpu_indices", [])]
    if worker.devices == "all":
        if not present:
            raise ConfigError(
                f"{key}.devices=all: host {worker.host} has no GPU (nvidia-smi/KFD found none); "
                "use devices: cpu for CPU ranks"
            )
        return [("cuda", g, 1.0) for g in present]
    missing = [g for g in worker.devices if g not in present]
    if missing:
        have = ", ".join(map(str, present)) or "none"
        raise ConfigError(
            f"{key}.devices={list(worker.devices)}: host {worker.host} has no GPU "
            f"{', '.join(map(str, missing))} (it has: {have})"
        )
    return [("cuda", g, 1.0) for g in worker.devices]
