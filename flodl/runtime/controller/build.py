"""The controller of a job, built from its spec and topology in one place: by the launcher
(:class:`flodl.job.Job`) and by task 0 of a ``controller: rank0`` SLURM job, which runs only the
controller and its own rank and hands the result back to the submitter."""

from __future__ import annotations

import hashlib
from pathlib import Path

from flodl.placement.topology import Topology
from flodl.runtime.controller.controller import Controller, ControllerResult, Hooks
from flodl.runtime.controller.snapshots import Checkpointer, ResumePoint
from flodl.runtime.wire.job_spec import JobSpec


def checkpointer(spec: JobSpec, world_size: int) -> Checkpointer | None:
    """The checkpoint writer of ``trainer.save_path`` (None: nothing is saved)."""
    cfg = spec.config
    if cfg.save_path is None:
        return None
    digest = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
    return Checkpointer(cfg.save_path, cfg.checkpoint_every, digest, world_size)


def new_controller(
    spec: JobSpec,
    topology: Topology,
    hooks: Hooks,
    resume: ResumePoint | None,
    eval_metric: str = "eval",
) -> Controller:
    return Controller(
        spec.config,
        topology.world_size,
        topology.speeds,
        spec.has_eval,
        hooks,
        checkpointer=checkpointer(spec, topology.world_size),
        resume=resume,
        eval_metric=eval_metric,
        batch_sizes=topology.batch_sizes,
    )


def control_only(spec: JobSpec, job_dir: Path, topology: Topology) -> ControllerResult:
    """Run just the controller and this process's rank (task 0 of a ``controller: rank0``
    SLURM job): the submitting launcher writes the outputs from the returned result."""
    from flodl.preflight import check_run
    from flodl.runtime.cohorts.external import ExternalCohort
    from flodl.runtime.cohorts.protocol import run_cohort

    resume = check_run(spec.config, topology.world_size, None)
    controller = new_controller(spec, topology, Hooks(), resume)
    job_dir.mkdir(parents=True, exist_ok=True)
    cohort = ExternalCohort(spec, controller, job_dir, topology)
    controller.hooks.kill_rank = cohort.lose
    return run_cohort(cohort, lambda: False)
