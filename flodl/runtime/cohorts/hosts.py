"""The hosts cohort (``cluster.kind=hosts``): the ranks of a cluster file's workers.

A rank on a remote worker is started by the OpenSSH client (:mod:`flodl.placement.remote`) with
just its
role variables and the worker's own; its stdin stays open after the secret as its lifeline
(EOF: the launcher or its ssh link is gone, so the rank exits). A worker on this host runs its
ranks as local children, in its ``project_path`` with its ``python`` and environment.
"""

from __future__ import annotations

import sys

from flodl.placement import remote
from flodl.placement.topology import Placement
from flodl.runtime.cohorts.children import ProcessCohort
from flodl.runtime.wire import rank_env


class HostsCohort(ProcessCohort):
    """Children of the cluster file's workers: over ssh when remote, local otherwise."""

    def _command(self, place: Placement, controller: str) -> tuple[list[str], dict | None, bool]:
        if place.worker is None:
            return super()._command(place, controller)
        worker = self.spec.config.cluster.workers[place.worker]
        entry = self.spec.entry or ["-m", "flodl.runtime.rank"]
        world = self.spec.world_size
        if worker.remote:
            env = {
                **remote.worker_env(worker),
                **rank_env.role_env(place.rank, world, controller, place.device, place.gpu),
                rank_env.LIFELINE: "1",
            }
            argv = remote.ssh_argv(worker, remote.shell_line(worker, env, ["-u", *entry]))
            return argv, None, True
        env = rank_env.child_env(place.rank, world, controller, place.device, place.gpu)
        env.update(remote.worker_env(worker))
        python = worker.python if worker.python != "python3" else sys.executable
        return [python, "-u", *entry], env, False

    def _cwd(self, place: Placement) -> str | None:
        if place.worker is None:
            return None
        worker = self.spec.config.cluster.workers[place.worker]
        return None if worker.remote else worker.project_path
