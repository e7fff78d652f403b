"""Ranks another launcher placed: torchrun, ``srun``, submitit.

Every process of the cohort runs the user's entry point (``run.py`` or a script calling
``Trainer.run``). Rank 0 becomes the launcher: it hosts the controller, and its own worker trains
on a thread beside it, connected over loopback like any other rank. The other ranks are followers:
they find the controller through the launcher's rendezvous store at ``MASTER_ADDR:MASTER_PORT``
(torchrun's own store when its agent hosts one), authenticate, and run the controller's plans.

The control-plane secret never crosses the rendezvous store, which has no authentication
(anyone who reaches ``MASTER_PORT`` can read and write it):

* with ``FLODL_SECRET_FILE`` set (a file every rank can read, e.g. on a shared file system, mode
  0600), every rank reads it there;
* without it, on one host (torchrun's ``LOCAL_WORLD_SIZE`` equals ``WORLD_SIZE``; srun on one
  node), rank 0 draws a fresh secret and hands it, with the controller's address, to its
  followers in a 0600 file of a 0700 folder that only this user can read
  (``$TMPDIR/flodl-<uid>/``); the store carries only that file's random name, so a stranger who
  rewrites it can at worst make the followers fail to authenticate, never run their code;
* across hosts without it the placement is refused, saying so: nothing else torchrun gives the
  ranks is secret.

Placed ranks cannot be restarted or signalled by us: a lost follower is dropped like any lost rank,
but torchrun itself stops the survivors when a worker exits non-zero (its ``--max-restarts``
policy), which is why flodl's own launcher is the elastic path.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from flodl.config import Mode, TrainerConfig
from flodl.placement.topology import Topology
from flodl.runtime.cohorts.control_server import ControlPlane
from flodl.runtime.controller.controller import Controller, ControllerResult, RunFailed
from flodl.runtime.wire import rank_env
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.store import serve_store, shared_store

log = logging.getLogger(__name__)

_RUNS = itertools.count()  # one per job: rank 0 and its followers count the same jobs


def next_run_key(role: rank_env.ExternalRole) -> str:
    """Store prefix of the next job of this process (restart-aware: torchrun reuses its store)."""
    return f"flodl/{role.restart}/{next(_RUNS)}/"


def placed_store(role: rank_env.ExternalRole, timeout_s: float) -> Any:
    """The store of a placed rank (torchrun, srun) at MASTER_ADDR:MASTER_PORT: torchrun's agent
    store, or rank 0's."""
    return shared_store(
        role.master_addr, role.master_port, role.rank == 0 and not role.agent_store, timeout_s
    )


def _file_secret(role: rank_env.ExternalRole) -> bytes | None:
    path = role.secret_file
    if not path:
        return None
    text = Path(path).read_text().strip()
    if not text:
        raise RuntimeError(f"{rank_env.SECRET_FILE}={path} is empty")
    try:
        return bytes.fromhex(text)
    except ValueError:
        return text.encode()


def _check_secret_source(role: rank_env.ExternalRole) -> None:
    """Across hosts the secret must come from FLODL_SECRET_FILE: refuse otherwise."""
    if role.secret_file or role.single_host:
        return
    where = "spans several hosts" if role.single_host is False else "may span several hosts"
    raise RuntimeError(
        f"this {role.launcher} placement {where}, and the rendezvous store at "
        f"{role.master_addr}:{role.master_port} has no authentication: set "
        f"{rank_env.SECRET_FILE}=<a file every rank can read, mode 0600, holding a random hex "
        "string> (e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > ~/.flodl-secret`"
        " on a shared file system)"
    )


def private_dir() -> Path:
    """This user's 0700 hand-off folder on this host, refused if anyone else could use it."""
    folder = Path(tempfile.gettempdir()) / f"flodl-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{folder} is not a private folder of this user (mode 0700): remove it")
    return folder


_HANDOFF_NAME = re.compile(r"^[0-9a-f]{32}$")


def _handoff_path(name: str) -> Path:
    if not _HANDOFF_NAME.match(name):
        raise RuntimeError(f"the rendezvous store holds a bad hand-off name {name[:40]!r}")
    return private_dir() / f"{name}.json"


def _write_private(path: Path, data: dict) -> None:
    """Write ``data`` as JSON readable by its owner only, appearing all at once (rename)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as sink:
        json.dump(data, sink)
    os.replace(tmp, path)


def _read_when_written(path: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not publish {path} within {timeout_s:.0f} s")
        time.sleep(0.1)
    published: dict = json.loads(path.read_text())
    return published


def _bind_address(master_addr: str) -> str:
    """Listen where followers will look (MASTER_ADDR); loopback stays loopback."""
    import socket

    try:
        address = socket.gethostbyname(master_addr)
    except OSError:
        return "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return "0.0.0.0"  # MASTER_ADDR names a front (NAT, alias): take every interface
    return address


class ExternalCohort:
    """Rank 0's side: host the controller, publish where it is, train rank 0 on a thread."""

    def __init__(
        self, spec: JobSpec, controller: Controller, job_dir: Path, topology: Topology
    ) -> None:
        assert topology.external is not None
        self.role = topology.external
        self.spec = spec
        self.controller = controller
        self.job_dir = job_dir
        self.plane = ControlPlane(controller, _file_secret(self.role))
        self.plane.own_ranks = {0}  # rank 0 trains in this process: never told to exit
        self._store: Any = None
        self._handoff: Path | None = None
        self._worker: threading.Thread | None = None
        self._failures: list[BaseException] = []

    @property
    def control_address(self) -> tuple[str, int]:
        return self.plane.address

    def start(self) -> None:
        """Listen, publish the controller to the followers, start rank 0's worker thread."""
        role = self.role
        host, port = self.plane.listen(_bind_address(role.master_addr), 0)
        key = next_run_key(role)
        store_host, store_port = self._publish(key, f"{role.master_addr}:{port}")
        log.info("%s placement: controller on port %d", role.launcher, port)
        spec = replace(
            self.spec, store_host=store_host, store_port=store_port, store_prefix=key + "data"
        )
        self.plane.serve(spec)
        here = "127.0.0.1" if host == "0.0.0.0" else host
        local = rank_env.RankEnv(0, role.world_size, here, port, role.device, role.local_rank)
        self._worker = threading.Thread(
            target=_own_rank, args=(local, self.plane.secret, self._failures), name="flodl-rank0"
        )
        self._worker.daemon = True
        self._worker.start()

    def _publish(self, key: str, controller: str) -> tuple[str, int]:
        """Tell the followers where the controller is; the data plane's store address."""
        role, secret = self.role, self.plane.secret.hex()
        if role.rendezvous_file:  # placed by our SLURM launcher: a file in the job's folder
            self._store = serve_store(_bind_address(role.master_addr))
            _write_private(Path(role.rendezvous_file), {"controller": controller, "secret": secret})
            return role.master_addr, self._store.port
        _check_secret_source(role)  # torchrun / srun: their store at MASTER_ADDR:MASTER_PORT
        self._store = placed_store(role, self.spec.config.cluster.start_timeout_s)
        if role.secret_file:
            self._store.set(key + "controller", controller)
        else:  # one host: the secret and address go through this user's private folder
            name = secrets.token_hex(16)
            self._handoff = _handoff_path(name)
            _write_private(self._handoff, {"controller": controller, "secret": secret})
            self._store.set(key + "handoff", name)
        return role.master_addr, role.master_port

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        try:
            result = self.controller.run(stop_requested)
        except RunFailed:
            if self._failures:
                log.debug("rank 0 worker failed: %r", self._failures[0])
            raise
        self.plane.await_goodbyes()
        if self._worker is not None:
            self._worker.join(timeout=30.0)
        return result

    def lose(self, rank: int) -> None:
        """A placed rank is not ours to signal: its loss shows as a closed channel."""

    def outputs(self) -> list[Path]:
        return []  # every placed rank logs where its launcher sends its output

    def stop(self, failure: BaseException | None) -> None:
        if failure is not None:
            self.plane.abort(failure)
        self.plane.close()
        if self._handoff is not None:
            self._handoff.unlink(missing_ok=True)
        self._store = None


def _own_rank(role: rank_env.RankEnv, secret: bytes, failures: list[BaseException]) -> None:
    from flodl.runtime.rank.process import run_managed

    try:
        run_managed(role, secret, in_launcher=True)
    except BaseException as exc:  # reported to the controller by run_managed already
        failures.append(exc)


def follow_job(role: rank_env.ExternalRole, config: TrainerConfig) -> int:
    """A follower's part in one job (see :func:`flodl.runtime.wire.rank_env.is_follower`): train
    as a follower of rank 0's; the exit code (a solo job trains on rank 0 alone: nothing to do)."""
    if config.elche.mode is Mode.SOLO:
        return 0
    return follow(role, config.cluster.start_timeout_s)


def follow(role: rank_env.ExternalRole, timeout_s: float = 120.0) -> int:
    """A follower: find this job's controller in the store, join it, train; the exit code."""
    from flodl.runtime.rank.process import run_managed

    key = next_run_key(role)
    rendezvous_file = role.rendezvous_file
    if rendezvous_file:
        published = _read_when_written(Path(rendezvous_file), timeout_s)
        controller, secret = published["controller"], bytes.fromhex(published["secret"])
    else:
        _check_secret_source(role)
        store = placed_store(role, timeout_s)
        file_secret = _file_secret(role)
        if file_secret is not None:
            store.wait([key + "controller"], timedelta(seconds=timeout_s))
            controller, secret = store.get(key + "controller").decode(), file_secret
        else:
            store.wait([key + "handoff"], timedelta(seconds=timeout_s))
            path = _handoff_path(store.get(key + "handoff").decode(errors="replace"))
            published = _read_when_written(path, timeout_s)
            controller, secret = published["controller"], bytes.fromhex(published["secret"])
        del store
    host, _, port = controller.rpartition(":")
    local = rank_env.RankEnv(
        role.rank, role.world_size, host, int(port), role.device, role.local_rank
    )
    return run_managed(local, secret)
