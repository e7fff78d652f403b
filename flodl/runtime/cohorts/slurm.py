"""``cluster=slurm``: ranks placed by SLURM through submitit (the engine of Hydra's SLURM launcher).

One submitit job of ``nodes x tasks_per_node`` tasks; each task is one rank and reads its rank
from SLURM's environment (``submitit.JobEnvironment``). Two places for the controller:

* ``controller: submitter`` (default): the launcher keeps the controller, as on one machine; the
  tasks connect back to ``cluster.controller.host``, which must be reachable from the nodes. The
  secret travels in a file of the job's submitit folder (mode 0600 in a 0700 directory, deleted at
  the end), never on a command line.
* ``controller: rank0``: for submit hosts the nodes cannot reach. Task 0 hosts the controller
  beside its own worker (the placed-rank path of :mod:`flodl.runtime.cohorts.external`) on free
  ports,
  and publishes them with the secret in a 0600 file of the job's submitit folder, which every node
  sees; the launcher waits for the allocation and writes the outputs from the result task 0 sends
  back. Live progress then appears in task 0's log only.
* ``controller: auto`` (default): ``rank0`` on a real SLURM cluster while ``controller.host`` is
  loopback, else ``submitter``.

``executor: local`` runs the same tasks on this machine (submitit's local executor): how the
SLURM path is tested without a cluster.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flodl.config import SlurmConfig
from flodl.config.extras import require
from flodl.placement.topology import Topology
from flodl.runtime.cohorts.children import QUIET_PREFIXES
from flodl.runtime.cohorts.control_server import GOODBYE_S, ControlPlane
from flodl.runtime.controller.controller import Controller, ControllerResult, Exited
from flodl.runtime.wire import rank_env
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.store import serve_store

log = logging.getLogger(__name__)


def make_executor(slurm: SlurmConfig, folder: Path) -> Any:
    """A submitit executor for the allocation (``auto``: SLURM where it is installed)."""
    require("submitit", "cluster.kind=slurm")
    import submitit

    cluster = None if slurm.executor == "auto" else slurm.executor
    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    params: dict[str, Any] = {
        "nodes": slurm.nodes,
        "tasks_per_node": slurm.tasks_per_node,
        "gpus_per_node": slurm.gpus_per_node,
        "timeout_min": slurm.time_min,
        "name": "flodl",
    }
    if slurm.cpus_per_task is not None:
        params["cpus_per_task"] = slurm.cpus_per_task
    if executor.cluster == "slurm":
        if slurm.partition:
            params["slurm_partition"] = slurm.partition
        if slurm.additional_parameters:
            params["slurm_additional_parameters"] = dict(slurm.additional_parameters)
    executor.update_parameters(**params)
    return executor


def controller_placement(slurm: SlurmConfig, controller_host: str, executor: str) -> bool:
    """True when the controller must run beside rank 0: asked for, or (``auto``) when the
    tasks run on other nodes and ``controller.host`` is loopback, which they could not reach."""
    if slurm.controller != "auto":
        return slurm.controller == "rank0"
    loopback = controller_host in ("127.0.0.1", "localhost", "::1")
    return executor != "local" and loopback


def _device(slurm: SlurmConfig) -> str:
    return "cuda" if slurm.gpus_per_node else "cpu"


def task_main(controller: str, secret_file: str, device: str) -> int:
    """One SLURM task of ``controller: submitter``: join the launcher's controller and train."""
    require("submitit", "cluster.kind=slurm")
    import submitit

    from flodl.runtime.rank.process import run_managed

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    job = submitit.JobEnvironment()
    host, _, port = controller.rpartition(":")
    role = rank_env.RankEnv(job.global_rank, job.num_tasks, host, int(port), device, job.local_rank)
    secret = bytes.fromhex(Path(secret_file).read_text().strip())
    code = run_managed(role, secret)
    if code:
        raise RuntimeError(f"rank {job.global_rank} failed (exit {code}); see the controller")
    return code


def rank0_task(spec: Any, job_dir: str, rendezvous_file: str) -> Any:
    """One SLURM task of ``controller: rank0``: task 0 runs the controller, the others follow.

    Task 0 binds free ports and publishes them, with the secret, in ``rendezvous_file`` (0600, in
    the job's 0700 submitit folder, which every node sees: submitit itself needs it shared), so no
    fixed port can collide and the secret never crosses the network.
    """
    require("submitit", "cluster.kind=slurm")
    import submitit

    from flodl.runtime.cohorts.external import follow

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    role = rank_env.submitit_role(submitit.JobEnvironment(), rendezvous_file)
    if role.rank != 0:
        code = follow(role, spec.config.cluster.start_timeout_s)
        if code:
            raise RuntimeError(f"rank {role.rank} failed (exit {code}); see task 0's log")
        return None
    from flodl.placement.topology import resolve_topology
    from flodl.runtime.controller.build import control_only

    topology = resolve_topology(spec.config, placed=role)
    return control_only(spec, Path(job_dir), topology)


def _wait_done(job: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not job.done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


class _Tail(threading.Thread):
    """Follow one task's submitit log files into ``rank_N.log`` and the console."""

    def __init__(
        self, echo: Callable[[str], None], log_path: Path, rank: int, paths: list[Path]
    ) -> None:
        super().__init__(name=f"slurm{rank}-tail", daemon=True)
        self.echo, self.log_path, self.rank, self.paths = echo, log_path, rank, paths
        self.tail: list[str] = []
        self.finished = threading.Event()

    def run(self) -> None:
        offsets = dict.fromkeys(self.paths, 0)
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as sink:
            while True:
                last_pass = self.finished.is_set()
                for path in self.paths:
                    if not path.exists():
                        continue
                    with open(path, encoding="utf-8", errors="replace") as src:
                        src.seek(offsets[path])
                        chunk = src.read()
                        if not chunk.endswith("\n") and not last_pass:
                            chunk = chunk[: chunk.rfind("\n") + 1]
                        offsets[path] += len(chunk.encode("utf-8", errors="replace"))
                    for line in chunk.splitlines():
                        sink.write(line + "\n")
                        self.tail = [*self.tail[-19:], line]
                        if not line.startswith(QUIET_PREFIXES) and line.strip():
                            self.echo(f"[slurm:{self.rank}] {line}")
                    sink.flush()
                if last_pass:
                    return
                time.sleep(0.2)

    def last_error_line(self) -> str:
        for line in reversed(self.tail):
            if line.strip() and not line.startswith(QUIET_PREFIXES):
                return line.strip()
        return ""


class SlurmCohort:
    """``controller: submitter``: the tasks connect back to this process's control plane."""

    def __init__(
        self,
        spec: JobSpec,
        controller: Controller,
        job_dir: Path,
        topology: Topology,
        echo: Callable[[str], None] | None = None,
        executor: Any = None,
    ) -> None:
        self.spec, self.controller, self.job_dir = spec, controller, job_dir
        self.slurm = _slurm(spec)
        self.echo = echo or _to_stderr
        self.folder = private_folder(job_dir, self.slurm)
        self.executor = executor or make_executor(self.slurm, self.folder)
        self.plane = ControlPlane(controller)
        self.job: Any = None
        self._tails: list[_Tail] = []
        self._store: Any = None

    def start(self) -> None:
        address = self.spec.config.cluster.controller
        host, port = self.plane.listen(address.host, address.port)
        self._store = serve_store(address.host, address.port + 1 if address.port else 0)
        self.plane.serve(replace(self.spec, store_host=address.host, store_port=self._store.port))
        secret_file = self.folder / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as sink:
            sink.write(self.plane.secret.hex())
        device = _device(self.slurm)
        self.job = self.executor.submit(task_main, f"{host}:{port}", str(secret_file), device)
        log.info("slurm job %s: %d task(s)", self.job.job_id, self.slurm.world_size)
        self._tails = [_tail(self, r) for r in range(self.slurm.world_size)]
        threading.Thread(target=self._watch, name="flodl-slurm", daemon=True).start()

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        result = self.controller.run(stop_requested)
        self.plane.await_goodbyes()
        return result

    def _watch(self) -> None:
        """The allocation ended (all tasks, or cancelled): every rank still a member has exited."""
        while not self.plane.closing and not self.job.done():
            time.sleep(0.2)
        if self.plane.closing:
            return
        for rank, tail in enumerate(self._tails):
            tail.finished.set()
            tail.join(timeout=2.0)
            try:
                self.job.task(rank).result()
                code = 0
            except Exception:
                code = 1
            self.controller.post(rank, Exited(code, tail.last_error_line()))

    def lose(self, rank: int) -> None:
        log.warning("slurm: rank %d went silent; its task cannot be cancelled alone", rank)

    def outputs(self) -> list[Path]:
        return [self.job_dir / f"rank_{r}.log" for r in range(len(self._tails))]

    def stop(self, failure: BaseException | None) -> None:
        """Ranks leave on the controller's stop; cancel only what still runs after that."""
        self.plane.close()
        _end(self.job, self._tails, self.folder)
        (self.folder / "secret").unlink(missing_ok=True)
        self._store = None


class SlurmRank0Cohort:
    """``controller: rank0``: the whole job runs in the allocation; task 0 hosts the controller
    (:func:`rank0_task`) and sends its result back."""

    def __init__(
        self,
        spec: JobSpec,
        job_dir: Path,
        echo: Callable[[str], None] | None = None,
        executor: Any = None,
    ) -> None:
        self.spec, self.job_dir = spec, job_dir
        self.slurm = _slurm(spec)
        self.echo = echo or _to_stderr
        self.folder = private_folder(job_dir, self.slurm)
        self.executor = executor or make_executor(self.slurm, self.folder)
        self.rendezvous = self.folder / "rendezvous.json"
        self.job: Any = None
        self._tails: list[_Tail] = []

    def start(self) -> None:
        self.rendezvous.unlink(missing_ok=True)
        self.job = self.executor.submit(
            rank0_task, self.spec, str(self.job_dir / "rank0"), str(self.rendezvous)
        )
        log.info(
            "slurm job %s: %d task(s), controller beside rank 0",
            self.job.job_id,
            self.slurm.world_size,
        )
        self._tails = [_tail(self, r) for r in range(self.slurm.world_size)]

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        while not self.job.done():
            if stop_requested():
                raise KeyboardInterrupt("stop requested: the allocation is cancelled")
            time.sleep(0.2)
        for tail in self._tails:
            tail.finished.set()
            tail.join(timeout=2.0)
        result: ControllerResult = self.job.results()[0]
        return result

    def lose(self, rank: int) -> None:
        log.warning("slurm: rank %d went silent; task 0 supervises it", rank)

    def outputs(self) -> list[Path]:
        return [self.job_dir / f"rank_{r}.log" for r in range(len(self._tails))]

    def stop(self, failure: BaseException | None) -> None:
        _end(self.job, self._tails, self.folder)
        self.rendezvous.unlink(missing_ok=True)


def slurm_cohort(
    spec: JobSpec,
    controller: Controller,
    job_dir: Path,
    topology: Topology,
    echo: Callable[[str], None] | None = None,
) -> SlurmCohort | SlurmRank0Cohort:
    """The SLURM cohort for ``cluster.slurm.controller`` (see :func:`controller_placement`)."""
    slurm = _slurm(spec)
    executor = make_executor(slurm, private_folder(job_dir, slurm))
    host = spec.config.cluster.controller.host
    if controller_placement(slurm, host, executor.cluster):
        return SlurmRank0Cohort(spec, job_dir, echo, executor)
    return SlurmCohort(spec, controller, job_dir, topology, echo, executor)


def _slurm(spec: JobSpec) -> SlurmConfig:
    slurm = spec.config.cluster.slurm
    assert slurm is not None, "cluster.kind=slurm without a slurm section"
    return slurm


def private_folder(job_dir: Path, slurm: SlurmConfig) -> Path:
    """The job's submitit folder, mode 0700: it holds the secret and the rendezvous file."""
    folder = job_dir / slurm.folder
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _tail(cohort: SlurmCohort | SlurmRank0Cohort, rank: int) -> _Tail:
    task = cohort.job.task(rank)
    log_path = cohort.job_dir / f"rank_{rank}.log"
    tail = _Tail(cohort.echo, log_path, rank, [Path(task.paths.stdout), Path(task.paths.stderr)])
    tail.start()
    return tail


def _end(job: Any, tails: list[_Tail], folder: Path) -> None:
    """Cancel what still runs after the grace period, stop the tails, drop submitit's pickles."""
    if job is not None and not _wait_done(job, GOODBYE_S):
        job.cancel(check=False)
        _wait_done(job, 10.0)
    for tail in tails:
        tail.finished.set()
        tail.join(timeout=2.0)
    for pickle in folder.glob("*_submitted.pkl"):
        pickle.unlink(missing_ok=True)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
