"""Cluster files, ClusterBuilder, placements and the ssh command lines, without any host."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from flodl import ClusterBuilder, ClusterConfig, ConfigError, SshConfig, TrainerConfig
from flodl.config import validate_run_config
from flodl.placement.remote import shell_line, ssh_argv, worker_env
from flodl.placement.topology import resolve_topology
from flodl.runtime.wire import rank_env

ROOT = Path(__file__).resolve().parents[2]


def two_hosts(**worker_b):
    return (
        ClusterBuilder()
        .controller("10.0.0.1", port=29400)
        .worker("10.0.0.2", devices=[0, 1], ssh="node-a", nccl_socket_ifname="eth0")
        .worker("10.0.0.3", **{"devices": "all", "ssh": {"user": "me"}, **worker_b})
        .build()
    )


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "cluster").glob("*.yaml")), ids=str)
def test_every_shipped_cluster_file_validates(path):
    stated = yaml.safe_load(path.read_text())
    assert stated.pop("defaults") == ["_schema", "_self_"]  # composes from the schema
    cluster = ClusterConfig.model_validate(stated)
    kinds = {"auto": "auto", "cpu_rig": "cpu_rig", "slurm": "slurm", "example_hosts": "hosts"}
    assert cluster.kind == kinds[path.stem]
    assert (cluster.slurm is not None) == (cluster.kind == "slurm")
    assert bool(cluster.workers) == (cluster.kind == "hosts")


def test_builder_gives_a_validated_hosts_cluster():
    cluster = two_hosts()
    assert cluster.kind == "hosts"
    assert (cluster.controller.host, cluster.controller.port) == ("10.0.0.1", 29400)
    assert [w.host for w in cluster.workers] == ["10.0.0.2", "10.0.0.3"]
    assert cluster.workers[0].ssh == SshConfig(target="node-a")
    assert cluster.workers[1].ssh is not None and cluster.workers[1].ssh.user == "me"
    TrainerConfig(cluster=cluster)  # fits the trainer's config bag


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda b: b.worker("10.0.0.2", devices="cpu"), "is remote: give it an ssh section"),
        (lambda b: b.worker("localhost", devices=[0, 0]), "distinct GPU indices"),
        (lambda b: b.worker("localhost", devices=[-1]), "distinct GPU indices"),
        (lambda b: b.worker("localhost", devices=[0], speeds=[0.5]), "set devices: cpu"),
        (lambda b: b.worker("localhost", devices="cpu", ranks=2, speeds=[1.0]), "ranks=2"),
        (lambda b: b.worker("localhost", devices="cpu", speeds=[1.5]), r"\(0, 1\]"),
        (lambda b: b.worker("localhost", devices="gpu"), "cluster.workers.0.devices"),
        (lambda b: b.worker("localhost").worker("localhost"), "same host"),
        (lambda b: b, "at least one entry in workers"),
        (
            lambda b: b.controller("127.0.0.1").worker("10.0.0.2", ssh="n"),
            "controller.host is loopback but workers are remote",
        ),
        (lambda b: b.controller("10.0.0.1", port=70000).worker("localhost"), "port"),
        (lambda b: b.worker("localhost", ssh={"port": 0}), "cluster.workers.0.ssh.port"),
        (lambda b: b.worker("localhost", ssh={"bogus": 1}), "unknown key"),
    ],
)
def test_bad_cluster_files_are_refused_naming_the_key(build, message):
    with pytest.raises(ConfigError, match=message):
        build(ClusterBuilder()).build()


def test_sections_belong_to_their_kind():
    with pytest.raises(ValueError, match="only read with kind=hosts"):
        ClusterConfig(kind="cpu_rig", workers=[{"host": "localhost"}])
    with pytest.raises(ValueError, match="needs a slurm section"):
        ClusterConfig(kind="slurm")
    cfg = validate_run_config(_run_config({"kind": "slurm", "slurm": {"nodes": 2}}))
    assert cfg.cluster.slurm is not None and cfg.cluster.slurm.world_size == 2
    with pytest.raises(ConfigError, match=r"cluster.slurm.executor=pbs"):
        validate_run_config(_run_config({"kind": "slurm", "slurm": {"executor": "pbs"}}))


def _run_config(cluster: dict) -> dict:
    from .test_config import _run_data

    return _run_data(cluster=cluster)


def test_ssh_argv_is_batch_mode_with_keepalives_and_no_secret():
    cluster = two_hosts()
    worker = cluster.workers[0].model_copy(
        update={
            "ssh": SshConfig(target="node-a", port=2222, identity_file="~/k", options={"A": "b"})
        }
    )
    line = shell_line(worker, {"FLODL_RANK": "0", "X": "a b"}, ["-u", "-m", "flodl.runtime.rank"])
    argv = ssh_argv(worker, line)
    assert argv[:3] == ["ssh", "-T", "-o"] and "BatchMode=yes" in argv
    assert "ServerAliveInterval=5" in argv and "ServerAliveCountMax=3" in argv
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-o", 8) + 1]
    assert "A=b" in argv
    assert argv[-3:-1] == ["node-a", "--"]
    remote = shlex.split(argv[-1])
    assert remote[:3] == ["cd", remote[1], "&&"]
    assert "X=a b" in remote and "FLODL_RANK=0" in remote
    assert remote[-4:] == ["python3", "-u", "-m", "flodl.runtime.rank"]
    assert not any("SECRET" in a.upper() for a in argv)


def test_worker_env_sets_both_socket_interfaces_without_overriding_the_users():
    cluster = two_hosts()
    assert worker_env(cluster.workers[0]) == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    w = cluster.workers[0].model_copy(update={"env": {"GLOO_SOCKET_IFNAME": "ib0"}})
    assert worker_env(w)["GLOO_SOCKET_IFNAME"] == "ib0"


def fake_facts(monkeypatch, per_host):
    def facts(workers):
        return {i: {"gpu_indices": per_host[i]} for i in range(len(workers))}

    monkeypatch.setattr("flodl.placement.remote.host_facts_all", facts)


def test_global_ranks_follow_worker_order_and_all_is_resolved_on_the_host(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    fake_facts(monkeypatch, {0: [0, 1, 2], 1: [0, 1, 2, 3]})
    topo = resolve_topology(TrainerConfig(cluster=two_hosts()))
    assert topo.kind == "hosts" and topo.backend == "nccl" and topo.world_size == 6
    assert [(p.rank, p.worker, p.gpu) for p in topo.placements] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
        (4, 1, 2),
        (5, 1, 3),
    ]
    assert topo.placements[3].label == "10.0.0.3:3"


def test_missing_devices_are_refused_before_any_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    fake_facts(monkeypatch, {0: [0], 1: []})
    with pytest.raises(ConfigError, match=r"cluster.workers.0.devices=\[0, 1\]: .* no GPU 1"):
        resolve_topology(TrainerConfig(cluster=two_hosts()))
    fake_facts(monkeypatch, {0: [0, 1], 1: []})
    with pytest.raises(ConfigError, match=r"cluster.workers.1.devices=all: host 10.0.0.3 has no"):
        resolve_topology(TrainerConfig(cluster=two_hosts()))


def test_cpu_workers_pace_like_the_rig_and_mixing_backends_is_refused(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    fake_facts(monkeypatch, {0: [], 1: []})
    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("10.0.0.2", devices="cpu", ranks=2, speeds=[1.0, 0.5], ssh="a")
        .worker("10.0.0.3", devices="cpu", ssh="b")
        .build()
    )
    topo = resolve_topology(TrainerConfig(cluster=cluster))
    assert topo.backend == "gloo" and topo.pace and topo.speeds == [1.0, 0.5, 1.0]
    fake_facts(monkeypatch, {0: [0, 1], 1: []})
    mixed = two_hosts(devices="cpu")
    with pytest.raises(ConfigError, match="mix GPU and CPU ranks"):
        resolve_topology(TrainerConfig(cluster=mixed))


def test_all_local_gpus_is_the_auto_promote_topology(monkeypatch):
    from flodl.placement.gpus import GpuInfo

    gpus = [
        GpuInfo(0, "A", None, 1000, None, physical_index=2),
        GpuInfo(1, "B", None, 1000, None, physical_index=5),
    ]
    monkeypatch.setattr("flodl.placement.gpus.detect_gpus", lambda: gpus)
    cluster = ClusterBuilder.all_local_gpus()
    assert cluster.controller.host == "127.0.0.1"
    assert [w.host for w in cluster.workers] == ["localhost"]
    assert cluster.workers[0].devices == [2, 5] and cluster.workers[0].ssh is None
    monkeypatch.setattr("flodl.placement.gpus.detect_gpus", list)
    with pytest.raises(ConfigError, match="no GPU visible"):
        ClusterBuilder.all_local_gpus()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"FLODL_ROLE": "rank", "RANK": "1", "WORLD_SIZE": "2"}, None),  # ours, not external
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
                "FLODL_DEVICE": "cpu",
            },
            ("torchrun", 1, 2, 0),
        ),
    ],
)
def test_external_role_reads_torchrun_variables(environ, expected):
    role = rank_env.external_role(environ)
    got = None if role is None else (role.launcher, role.rank, role.world_size, role.local_rank)
    assert got == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "without MASTER_ADDR, MASTER_PORT"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "bad torchrun"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
    ],
)
def test_a_broken_placement_environment_is_named(environ, message):
    with pytest.raises(RuntimeError, match=message):
        rank_env.external_role({**environ, "FLODL_DEVICE": "cpu"})


def test_placed_ranks_refuse_a_second_placement(monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("FLODL_DEVICE", "cpu")
    topo = resolve_topology(TrainerConfig())
    assert topo.kind == "external" and topo.world_size == 2 and topo.backend == "gloo"
    with pytest.raises(ConfigError, match="placed by torchrun"):
        resolve_topology(TrainerConfig(cluster=two_hosts()))
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        resolve_topology(
            TrainerConfig(cluster=ClusterConfig(kind="cpu_rig", ranks=3, speeds=[1, 1, 1]))
        )


@pytest.mark.parametrize(
    ("where", "host", "executor", "beside_rank0"),
    [
        ("auto", "127.0.0.1", "slurm", True),  # nodes cannot reach a loopback submitter
        ("auto", "10.0.0.1", "slurm", False),
        ("auto", "127.0.0.1", "local", False),  # local tasks reach loopback
        ("rank0", "10.0.0.1", "slurm", True),
        ("submitter", "127.0.0.1", "slurm", False),
    ],
)
def test_slurm_controller_placement(where, host, executor, beside_rank0):
    from flodl.config import SlurmConfig
    from flodl.runtime.cohorts.slurm import controller_placement

    slurm = SlurmConfig(controller=where)
    assert controller_placement(slurm, host, executor) is beside_rank0
