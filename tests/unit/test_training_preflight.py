"""Launch-time resolution of per-rank batch sizes and precision refusals (no rank, no CUDA)."""

from __future__ import annotations

import pytest

from flodl.config import ClusterConfig, ConfigError, TrainerConfig, WorkerConfig
from flodl.placement.topology import resolve_topology
from flodl.preflight import check_config, rank_batch_sizes


def _sizes(**cluster) -> list:
    cfg = TrainerConfig(batch_size=32, cluster=ClusterConfig(**cluster))
    return rank_batch_sizes(cfg, resolve_topology(cfg, probe_hosts=False))


def test_cpu_rig_sizes_default_to_trainer_batch_size():
    assert _sizes(kind="cpu_rig", ranks=2, batch_sizes=[64, 16]) == [64, 16]
    assert _sizes(kind="cpu_rig", ranks=3) == [32, 32, 32]


def test_a_host_workers_batch_size_applies_to_each_of_its_ranks():
    workers = [
        WorkerConfig(host="localhost", devices="cpu", ranks=2, batch_size=48),
        WorkerConfig(host="127.0.0.1", devices="cpu", ranks=1),
    ]
    assert _sizes(kind="hosts", workers=workers) == [48, 48, 32]


def test_auto_on_cpu_ranks_and_wrong_lengths_are_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"cluster\.batch_sizes=auto: rank\(s\) \[0, 1\]"):
        _sizes(kind="cpu_rig", ranks=2, batch_sizes="auto")
    with pytest.raises(ValueError, match="batch_sizes has 3 entries but ranks=2"):
        ClusterConfig(kind="cpu_rig", ranks=2, batch_sizes=[64, 16, 8])
    with pytest.raises(ValueError, match="batch_size on each worker"):
        ClusterConfig(
            kind="hosts", workers=[WorkerConfig(host="localhost", devices="cpu")], batch_sizes=[8]
        )


def test_16_mixed_is_refused_for_cpu_ranks_and_bf16_is_not():
    cpu = ClusterConfig(kind="cpu_rig", ranks=2)
    check_config(TrainerConfig(precision="bf16-mixed", cluster=cpu))
    with pytest.raises(ConfigError, match=r"use trainer\.precision=bf16-mixed"):
        check_config(TrainerConfig(precision="16-mixed", cluster=cpu))
    assert TrainerConfig(precision=32).precision == "32"  # YAML's integer 32


def test_auto_batch_search_finds_the_largest_fitting_size_in_few_probes():
    from dataclasses import dataclass, field
    from types import SimpleNamespace

    from flodl.runtime.rank import batch_probe

    def job():
        return SimpleNamespace(config=SimpleNamespace(cluster=ClusterConfig()))

    probes: list[int] = []

    @dataclass(frozen=True)
    class Probe:  # the probe's inputs, its step replaced by a size limit
        limit: int
        rank: int = 0
        spec: object = field(default_factory=job)

        def fits(self, dataset, size, budget):
            probes.append(size)
            return size <= self.limit

    assert batch_probe._search(Probe(37), range(1000), 1.0, 2**30) == 37  # type: ignore[arg-type]
    assert len(probes) <= 2 * 6 + 1  # doubling to 64, then bisecting 32..64
    assert batch_probe._search(Probe(10**6), range(20), 1.0, 2**30) == 20  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="cannot fit even one sample"):
        batch_probe._search(Probe(0), range(20), 1.0, 2**30)  # type: ignore[arg-type]


def test_solo_trains_with_rank_0s_size():
    from flodl.config import ElCheConfig

    cfg = TrainerConfig(
        elche=ElCheConfig(mode="solo"),
        cluster=ClusterConfig(kind="cpu_rig", ranks=2, batch_sizes=[64, 16]),
    )
    assert rank_batch_sizes(cfg, resolve_topology(cfg, probe_hosts=False)) == [64]


def test_the_placement_carries_each_ranks_batch_size_to_the_spec_and_the_planner():
    from flodl.placement.batches import place_batches
    from flodl.runtime.controller.controller import Controller
    from flodl.runtime.wire.job_spec import JobSpec

    rig = ClusterConfig(kind="cpu_rig", ranks=2, batch_sizes=[64, 16])
    cfg = TrainerConfig(batch_size=32, cluster=rig)
    topology = place_batches(resolve_topology(cfg, probe_hosts=False), cfg)
    assert topology.batch_sizes == (64, 16)
    spec = JobSpec(cfg, print, print, print, [], batch_sizes=list(topology.batch_sizes))
    assert [spec.batch_size_for(r) for r in range(2)] == [64, 16]
    # A spec the job did not complete runs every rank at trainer.batch_size.
    assert JobSpec(cfg, print, print, print, []).batch_size_for(1) == 32
    # The planner starts from the placement's sizes (Ready's replace them); a probed one
    # (None) is the nominal batch until its rank says.
    planner = Controller(cfg, 2, [1.0, 1.0], has_eval=False, batch_sizes=(64, None)).planner
    assert planner.batch_sizes == [64, 32]
