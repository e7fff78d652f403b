"""Ranks placed by other engines: torchrun (and its environment, which srun scripts export) and
SLURM through submitit's local executor. Real processes, real gloo, the same controller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QUICK = [
    "dataset=digits",
    "trainer.num_epochs=2",
    "trainer.batch_size=32",
    "cluster.warmup_steps=2",
    "logger.progress=lines",
    "logger.tensorboard=false",
]


def torchrun(args: list[str], cwd: Path, env: dict | None = None, nproc: int = 2):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_torchrun_places_run_py_ranks_on_one_controller(tmp_path):
    """run.py under torchrun, the secret in FLODL_SECRET_FILE (read by every rank, never sent);
    the Python API test below takes the other path: rank 0 publishes it in torchrun's store."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    out = tmp_path / "sweep"
    done = torchrun(
        [str(ROOT / "run.py"), *QUICK, "cluster=cpu_rig", f"hydra.sweep.dir={out}"],
        tmp_path,
        env={"FLODL_SECRET_FILE": str(secret)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "0" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    assert summary["coverage_exact"] is True
    # cluster.speeds [1.0, 0.5] pace torchrun's ranks like the rig: the fast one does more
    assert summary["per_rank_batch_share"][0] > 0.55
    # one job, one set of outputs (rank 0 writes them; rank 1 only trained)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["0"]
    assert "rank 1 finished with exit code 0" in done.stdout + done.stderr


SCRIPT = """
import json, sys
from functools import partial
from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.datasets import synthetic
from flodl.recipes.models import MLP
from flodl.recipes.steps import classification_step
import torch

def model(device):
    return MLP([1, 8, 8], 4, hidden=16).to(device)

state = (
    Trainer.builder(model, lambda p: torch.optim.Adam(p, lr=1e-2), classification_step)
    .dataset(partial(synthetic, "train", n_train=1024, n_test=64, input_shape=[1, 8, 8],
                     num_classes=4))
    .batch_size(32).num_epochs(2)
    .elche(ElCheConfig(mode=sys.argv[1]))
    .cluster(ClusterConfig(kind="cpu_rig", warmup_steps=2))
    .logger(LoggerConfig(progress="off", tensorboard=False))
    .output_dir(sys.argv[2])
    .run().join()
)
print("AFTER-RUN", json.dumps(sorted(state.params)))  # rank 0 only: the others exit in run()
"""


def test_torchrun_places_a_python_api_script(tmp_path, mode="cpu_cadence"):
    """The controller-averaged path (run.py above covers the collective one)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = torchrun(
        [str(script), mode, str(tmp_path / "out")],
        tmp_path,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("AFTER-RUN") == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["coverage_exact"] is True
    assert summary["samples_seen"] == 2 * 1024


def _free_port_from_15000() -> int:
    """A free port in 15000..24999: what a SLURM job id's last four digits map to."""
    import random
    import socket

    for port in random.sample(range(15000, 25000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 15000..24999")


def test_srun_style_placement_trains(tmp_path):
    """What ``srun --ntasks 2 python run.py`` gives each task (SLURM_PROCID / SLURM_NTASKS /
    SLURM_LOCALID / SLURM_STEP_ID / SLURM_NODELIST / SLURM_JOB_ID) when the batch script exports
    no MASTER_ADDR / MASTER_PORT: rank 0's host comes from the node list and the port from the
    job id, as Lightning's SLURMEnvironment derives them; the two tasks train one model."""
    port = _free_port_from_15000()
    out = tmp_path / "sweep"
    unset = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), *QUICK, f"hydra.sweep.dir={out}"],
            cwd=tmp_path,
            env={
                **base,
                "SLURM_PROCID": str(task),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(task),
                "SLURM_NNODES": "1",
                "SLURM_STEP_ID": "0",
                "SLURM_NODELIST": "localhost",
                "SLURM_JOB_ID": f"77{port - 15000:04d}",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for task in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    summary = json.loads((out / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["coverage_exact"] is True
    assert "srun: 2 ranks" in outputs[0]


@pytest.mark.light
def test_srun_environment_is_read(monkeypatch):
    from flodl.runtime.wire.rank_env import external_role

    role = external_role(
        {
            "SLURM_PROCID": "3",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1",
            "MASTER_ADDR": "node-a",
            "MASTER_PORT": "29500",
            "FLODL_DEVICE": "cpu",
        }
    )
    assert role is not None
    assert (role.launcher, role.rank, role.world_size, role.local_rank) == ("srun", 3, 4, 1)
    assert (role.master_addr, role.master_port, role.device) == ("node-a", 29500, "cpu")


@pytest.mark.light
def test_srun_without_master_addr_derives_it_or_fails_loudly():
    from flodl.runtime.wire.rank_env import external_role

    step = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    role = external_role(
        {
            **step,
            "SLURM_NODELIST": "gpu[007-010],cpu1",
            "SLURM_JOB_ID": "4321987",
            "FLODL_DEVICE": "cpu",
        }
    )
    assert role is not None and (role.launcher, role.rank, role.world_size) == ("srun", 1, 4)
    assert (role.master_addr, role.master_port) == ("gpu007", 15000 + 1987)
    with pytest.raises(RuntimeError, match="without MASTER_ADDR and without SLURM_NODELIST"):
        external_role({**step, "SLURM_JOB_ID": "12"})
    with pytest.raises(RuntimeError, match="bad range"):
        external_role({**step, "SLURM_NODELIST": "n[3-x]", "SLURM_JOB_ID": "12"})
    # a batch script itself (no step) or a one-task step is not a cohort
    assert external_role({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}) is None
    assert external_role({**step, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def slurm_run_py(args: list[str], cwd: Path, out: Path) -> subprocess.CompletedProcess:
    """run.py with cluster=slurm on submitit's local executor (the tasks run on this machine)."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *QUICK,
            "cluster=slurm",
            "cluster.slurm.executor=local",
            *args,
            f"hydra.sweep.dir={out}",
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("where", ["submitter", "rank0"])
def test_slurm_places_ranks_through_submitit(tmp_path, where):
    out = tmp_path / "sweep"
    done = slurm_run_py([f"cluster.slurm.controller={where}"], tmp_path, out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    job = out / "0"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 2
    assert summary["coverage_exact"] is True
    assert (job / "model.pt").exists()
    # each task's output reached rank_N.log, and SLURM's task ids are the ranks
    for rank in (0, 1):
        text = (job / f"rank_{rank}.log").read_text()
        assert f"global_rank={rank}(2)" in text
    folder = job / "slurm"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert not list(folder.glob("secret")) and not list(folder.glob("rendezvous.json"))
    assert not list(folder.glob("*_submitted.pkl"))
    assert "[slurm:1]" in done.stderr or "[slurm:1]" in done.stdout


@pytest.mark.light
def test_slurm_bad_config_is_refused_before_submission(tmp_path):
    out = tmp_path / "sweep"
    done = slurm_run_py(["task.train_step=flodl.recipes.steps.no_such_step"], tmp_path, out)
    assert done.returncode == 2  # refused before anything is submitted
    assert "task.train_step" in done.stderr
    assert not (out / "0" / "slurm").exists()
