"""Where a run's ranks go: one in-process device, one process per GPU, or the CPU rig."""

from __future__ import annotations

from dataclasses import dataclass

from flodl.config import Mode, TrainerConfig


@dataclass(frozen=True)
class Topology:
    world_size: int
    backend: str  # "gloo" or "nccl"
    speeds: list[float]
    pace: bool
    in_process: bool
    description: str
    gpus: tuple[int, ...] = ()  # physical GPU per rank (process-per-GPU cohorts)


def resolve_topology(config: TrainerConfig) -> Topology:
    """Decide the cohort from the cluster section (``auto`` probes GPUs without touching CUDA)."""
    cluster = config.cluster
    solo = config.elche.mode is Mode.SOLO
    if cluster.kind == "cpu_rig":
        speeds = cluster.rank_speeds()
        pace = cluster.speeds is not None
        if solo or cluster.ranks == 1:
            return Topology(1, "gloo", speeds[:1], pace, True, f"cpu_rig solo speed {speeds[0]}")
        desc = f"cpu_rig {cluster.ranks} ranks speeds {speeds}"
        return Topology(cluster.ranks, "gloo", speeds, pace, False, desc)
    from flodl.sys import detect_gpus

    gpus = detect_gpus()
    if len(gpus) >= 2 and not solo:
        names = " | ".join(g.name for g in gpus)
        desc = f"{len(gpus)} GPUs: {names}"
        physical = tuple(
            g.physical_index if g.physical_index is not None else g.index for g in gpus
        )
        return Topology(len(gpus), "nccl", [1.0] * len(gpus), False, False, desc, physical)
    return Topology(1, "gloo", [1.0], False, True, "single device, in-process")
