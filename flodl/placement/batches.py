"""Each rank's configured batch size, worked out once from the placement.

:func:`rank_batch_sizes` is the one owner of "rank r's batch size as configured": from
``cluster.batch_sizes``, a host worker's ``batch_size``, or ``trainer.batch_size`` (``None``
where ``cluster.batch_sizes: auto`` has the rank probe it). :func:`place_batches` records it on
the :class:`~flodl.placement.topology.Topology`; the preflight, the job spec the ranks receive and
the controller's planner read it from there. A rank may still change its own batch at start (the
``auto`` probe, a memory plan) and says so in its ``Ready``.
"""

from __future__ import annotations

from dataclasses import replace

from flodl.config import ConfigError, TrainerConfig
from flodl.placement.topology import Topology


def rank_devices(topology: Topology, device: str) -> list[str]:
    """``cpu`` or ``cuda`` for each rank, decided without touching CUDA."""
    if topology.in_process:
        if device == "auto":
            from flodl.placement.gpus import detect_gpus

            device = "cuda" if detect_gpus() else "cpu"
        return [device]
    return [p.device for p in topology.placements] or ["cpu"] * topology.world_size


def rank_batch_sizes(config: TrainerConfig, topology: Topology) -> list[int | None]:
    """Each rank's batch size (``None``: probed on the rank, ``auto``), from cluster.batch_sizes,
    a host worker's batch_size, or trainer.batch_size."""
    cluster, world = config.cluster, topology.world_size
    sizes: list[int | str | None]
    if isinstance(cluster.batch_sizes, list):
        solo = config.elche.mode.policy.alone  # rank 0 alone: its size
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


def place_batches(topology: Topology, config: TrainerConfig) -> Topology:
    """``topology`` carrying each rank's configured batch size (a refusal is a ConfigError)."""
    return replace(topology, batch_sizes=tuple(rank_batch_sizes(config, topology)))
