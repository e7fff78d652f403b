"""Cohort conformance: the same scenarios against every cohort that can run here.

Each scenario is one short real run through ``Trainer.run``, whose cohort comes from the one
factory (:func:`flodl.runtime.cohorts.factory.open_cohort`): start and train with every output
written,
lose a rank, stop on SIGINT. Cohorts: in-process (one device), local children (the CPU rig),
ssh hosts (network namespaces with their own sshd; skipped without root/sshd) and SLURM through
submitit's local executor. The torchrun/srun cohort (:class:`ExternalCohort`) is exercised by
``tests/integration/test_placement.py`` (run.py and a Python API script under real torchrun, an
srun-style placement); it is not asked to survive a lost rank, because torchrun itself stops the
survivors when a worker exits non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.config import SlurmConfig
from flodl.recipes.steps import classification_step
from flodl.runtime.controller.controller import RunFailed

from .helpers import data, model_factory, optim_factory
from .test_multihost import cluster_for

pytestmark = pytest.mark.slow

COHORTS = ["in_process", "children", "hosts", "slurm"]
# cohort -> (class the factory picks, ranks)
EXPECTED = {
    "in_process": ("InProcessCohort", 1),
    "children": ("ProcessCohort", 2),
    "hosts": ("HostsCohort", 2),
    "slurm": ("SlurmCohort", 2),
}


def _cluster(cohort: str, request: pytest.FixtureRequest) -> ClusterConfig:
    quick: dict[str, Any] = {"warmup_steps": 2, "heartbeat_timeout_s": 3.0}
    if cohort == "in_process":
        return ClusterConfig(kind="cpu_rig", ranks=1, **quick)
    if cohort == "children":
        return ClusterConfig(kind="cpu_rig", ranks=2, **quick)
    if cohort == "hosts":
        hosts = request.getfixturevalue("make_test_hosts")(2)
        return cluster_for(hosts, heartbeat_timeout_s=3.0)
    # submitit's tasks import this test's functions by module name (tests/ as on sys.path here)
    request.getfixturevalue("monkeypatch").setenv("PYTHONPATH", os.pathsep.join(sys.path))
    slurm = SlurmConfig(nodes=1, tasks_per_node=2, executor="local", controller="submitter")
    return ClusterConfig(kind="slurm", slurm=slurm, **quick)


def _run(tmp_path: Path, cluster: ClusterConfig, epochs: int, metrics_fn=None) -> Any:
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 1024))
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig.nccl_cadence())
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "job")
    )
    if metrics_fn is not None:
        builder = builder.metrics_fn(metrics_fn)
    return builder.run()


def _summary(handle: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((handle.job_dir / "summary.json").read_text())
    return data


@pytest.mark.parametrize("cohort", COHORTS)
def test_start_train_and_write_outputs(tmp_path, request, cohort):
    handle = _run(tmp_path, _cluster(cohort, request), epochs=1)
    handle.join(timeout=120)
    name, ranks = EXPECTED[cohort]
    started = handle._job.cohort
    assert type(started).__name__ == name
    result = handle.result
    assert result.summary.status == "ok" and result.summary.world_size == ranks
    assert result.coverage_exact and result.summary.samples_seen == 1024
    assert _summary(handle)["status"] == "ok" and (handle.job_dir / "model.pt").exists()
    outputs = started.outputs()
    assert len(outputs) == (0 if cohort == "in_process" else ranks)
    assert all(path.exists() for path in outputs)


@pytest.mark.parametrize("cohort", COHORTS)
def test_lose_a_rank(tmp_path, request, monkeypatch, cohort):
    """Rank 1 dies in its second window: the survivor finishes with the data covered. In
    process the only rank fails (raises, not killed: it is this test's own process)."""
    victim = "0:window:2:raise" if cohort == "in_process" else "1:window:2"
    monkeypatch.setenv("FLODL_CHAOS", victim)
    handle = _run(tmp_path, _cluster(cohort, request), epochs=2)
    if cohort == "in_process":
        with pytest.raises(RunFailed):
            handle.join(timeout=120)
        assert _summary(handle)["status"] == "failed"
        return
    handle.join(timeout=120)
    result = handle.result
    assert result.summary.status == "ok" and result.summary.lost_ranks == [1]
    assert result.coverage_exact and result.summary.samples_seen == 2 * 1024
    assert result.epochs[-1].per_rank_batch_share[1] == 0.0


@pytest.mark.parametrize("cohort", COHORTS)
def test_sigint_stops_gracefully(tmp_path, request, cohort):
    """SIGINT after the first epoch: every rank stops, the summary says interrupted, what was
    trained is in model.pt, and the caller sees the KeyboardInterrupt."""

    def interrupt(metrics) -> None:
        if metrics.epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)

    handle = _run(tmp_path, _cluster(cohort, request), epochs=20, metrics_fn=interrupt)
    with pytest.raises(KeyboardInterrupt):
        handle.join(timeout=120)
    summary = _summary(handle)
    assert summary["status"] == "interrupted" and 1 <= summary["epochs"] < 20
    assert (handle.job_dir / "model.pt").exists()
