"""The one factory of cohorts: which :class:`~flodl.runtime.cohorts.protocol.Cohort` a topology
gets.

========================  ==================================================================
``topology``              cohort
========================  ==================================================================
one device (in-process)   :class:`~flodl.runtime.cohorts.inprocess.InProcessCohort`: rank 0 is a
thread
CPU rig, local GPUs       :class:`~flodl.runtime.cohorts.children.ProcessCohort`: one child per rank
``cluster.kind=hosts``    :class:`~flodl.runtime.cohorts.hosts.HostsCohort`: children, over ssh
remotely
torchrun / srun placed    :class:`~flodl.runtime.cohorts.external.ExternalCohort`: rank 0 hosts the
rest
``cluster.kind=slurm``    :class:`~flodl.runtime.cohorts.slurm.SlurmCohort`: tasks through submitit
========================  ==================================================================

Every cohort that serves ranks composes the same
:class:`~flodl.runtime.cohorts.control_server.ControlPlane`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flodl.placement.topology import Topology
from flodl.runtime.cohorts.protocol import Cohort
from flodl.runtime.controller.controller import Controller
from flodl.runtime.wire.job_spec import JobSpec


def open_cohort(
    spec: JobSpec,
    controller: Controller,
    job_dir: Path,
    topology: Topology,
    echo: Callable[[str], None] | None = None,
    on_cooperative: Callable[[Any], None] | None = None,
) -> Cohort:
    """The cohort ``topology`` asks for; the controller's silent-rank hook goes to it."""
    cohort: Cohort
    if topology.in_process:
        from flodl.runtime.cohorts.inprocess import InProcessCohort

        cohort = InProcessCohort(spec, controller, on_cooperative)
    elif topology.kind == "external":
        from flodl.runtime.cohorts.external import ExternalCohort

        cohort = ExternalCohort(spec, controller, job_dir, topology)
    elif topology.kind == "slurm":
        from flodl.runtime.cohorts.slurm import slurm_cohort

        cohort = slurm_cohort(spec, controller, job_dir, topology, echo)
    elif topology.kind == "hosts":
        from flodl.runtime.cohorts.hosts import HostsCohort

        cohort = HostsCohort(spec, controller, job_dir, topology, echo)
    else:
        from flodl.runtime.cohorts.children import ProcessCohort

        cohort = ProcessCohort(spec, controller, job_dir, topology, echo)
    controller.hooks.kill_rank = cohort.lose
    return cohort
