"""``python -m flodl probe cluster=...``: every host of a cluster file checked over real ssh.

The hosts are network namespaces with their own sshd (tests/netns_hosts.py); they share this file
system, so the venv's Python and this checkout are there too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flodl import ClusterBuilder, SshConfig
from flodl.cli.probe import ClusterReport, Report, skew_checks
from tests.unit.test_probe import run_probe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def cluster_file(tmp_path: Path, hosts, extra_hosts=()) -> Path:
    """A cluster file over the test hosts (JSON is YAML), plus workers at ``extra_hosts``."""
    builder = ClusterBuilder().controller(hosts.controller_address)
    for address in [*hosts.addresses, *extra_hosts]:
        builder.worker(
            address,
            devices="cpu",
            ssh=SshConfig(config_file=hosts.ssh_config, connect_timeout_s=2),
            python=sys.executable,
            project_path=str(ROOT),
            nccl_socket_ifname=hosts.interface,
        )
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(builder.build().model_dump(mode="json")))
    return path


def test_ready_cluster(make_test_hosts, tmp_path):
    hosts = make_test_hosts(2)
    path = cluster_file(tmp_path, hosts)
    out = run_probe(f"cluster={path}", "--json", "--data-path", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ready"] is True and report["reasons"] == []
    assert [h["host"] for h in report["hosts"]] == hosts.addresses
    torches = {h["facts"]["torch"] for h in report["hosts"]}
    assert len(torches) == 1 and next(iter(torches)).startswith("2.")
    for host in report["hosts"]:
        checks = {c["name"]: c for c in host["checks"]}
        assert checks["ssh"]["ok"] and checks["data path"]["ok"] and checks["devices"]["ok"]

    table = run_probe(f"cluster={path}")
    assert table.returncode == 0, table.stdout + table.stderr
    rows = table.stdout.splitlines()
    for address in hosts.addresses:
        assert any(row.startswith(address) and " yes " in row for row in rows), table.stdout
    assert rows[-1] == "ready"


def test_unready_cluster_names_the_reasons(make_test_hosts, tmp_path):
    hosts = make_test_hosts(2)
    nowhere = hosts.controller_address.rsplit(".", 1)[0] + ".99"  # on the bridge, no host
    path = cluster_file(tmp_path, hosts, extra_hosts=[nowhere])
    out = run_probe(f"cluster={path}", "--json", "--data-path", "/nonexistent")
    assert out.returncode == 1, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ready"] is False
    reasons = "\n".join(report["reasons"])
    assert f"{nowhere}: ssh: unreachable: " in reasons
    for address in hosts.addresses:
        assert f"{address}: data path: /nonexistent missing" in reasons
    # The hosts that answered are still reported in full.
    assert all("torch" in h["facts"] for h in report["hosts"][:2])


def test_version_skew_is_not_ready():
    def host(name: str, torch: str) -> Report:
        facts = {"python": "3.11.7", "flodl": "0.1.0", "torch": torch, "cuda": None}
        return Report(host=name, facts={**facts, "nccl_version": None})

    hosts = [host("a", "2.13.0+cpu"), host("b", "2.12.1+cpu")]
    report = ClusterReport("hosts", hosts, skew_checks(hosts, nccl=False))
    assert not report.ready
    (reason,) = report.reasons
    assert reason.startswith("torch versions: differ") and "2.13.0+cpu on a" in reason
    assert "2.12.1+cpu on b" in reason

    same = [host("a", "2.13.0+cpu"), host("b", "2.13.0+cu121")]  # CUDA build: its own column
    assert ClusterReport("hosts", same, skew_checks(same, nccl=False)).ready


def test_nccl_skew_matters_only_for_a_gpu_cohort():
    hosts = [
        Report("a", facts={"nccl_version": "2.21.5"}),
        Report("b", facts={"nccl_version": "2.18.1"}),
    ]
    assert ClusterReport("hosts", hosts, skew_checks(hosts, nccl=False)).ready
    report = ClusterReport("hosts", hosts, skew_checks(hosts, nccl=True))
    assert report.reasons == ["nccl versions: differ across hosts: 2.21.5 on a; 2.18.1 on b"]


def test_bad_override_exits_2_naming_the_key():
    out = run_probe("cluster=cpu_rig", "cluster.controller.port=70000")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cluster.controller.port=70000: ")
    assert out.stdout == ""


def test_slurm_without_sbatch_falls_back_to_the_local_executor(monkeypatch):
    from flodl.cli.probe import slurm_checks
    from flodl.config import SlurmConfig

    monkeypatch.setenv("PATH", "/nonexistent")  # no srun, no sbatch
    checks = {c.name: c for c in slurm_checks(SlurmConfig(executor="auto"))[0]}
    assert checks["executor"].ok and "local executor" in checks["executor"].detail
    checks = {c.name: c for c in slurm_checks(SlurmConfig(executor="slurm"))[0]}
    assert not checks["executor"].ok and "no sbatch" in checks["executor"].detail


def test_devices_are_checked_against_the_host_gpus():
    from flodl.cli.probe import _devices_check
    from flodl.config import WorkerConfig

    facts = {"gpu_indices": [0, 1]}
    ok = _devices_check(0, WorkerConfig(host="localhost", devices=[0, 1]), facts)
    assert ok.ok and ok.detail == "GPU 0, 1: 2 rank(s)"
    missing = _devices_check(1, WorkerConfig(host="localhost", devices=[0, 3]), facts)
    assert not missing.ok and "cluster.workers.1.devices=[0, 3]" in missing.detail
    assert "no GPU 3" in missing.detail
    none = _devices_check(0, WorkerConfig(host="localhost", devices="all"), {"gpu_indices": []})
    assert not none.ok and "devices: cpu" in none.detail
