"""The local-children cohort: one child process per rank, their output, supervision, teardown.

The cohort hosts the control plane (:class:`~flodl.runtime.cohorts.control_server.ControlPlane`)
and the
``TCPStore`` the ranks rendezvous on (data plane). A local CPU rank is a fork of the launcher's
fork server (:mod:`flodl.runtime.cohorts.fork_server`: torch imported, nothing initialised), any
other a fresh
interpreter (``python -m flodl.runtime.rank``), never a fork of a process that has torch
initialised; on a worker host of a cluster file they are started by the OpenSSH client
(:mod:`flodl.runtime.cohorts.hosts`). Each child's output goes to ``<job_dir>/rank_N.log`` and,
prefixed ``[rank N]`` (``[host:N]`` for a remote rank), to the console when it is a warning, an
error or the user's own print.

The secret goes to each child's stdin, never to a command line. A remote rank's stdin stays open
as its lifeline: closing it (teardown) or losing the ssh link makes the remote rank exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flodl.placement.topology import Placement, Topology
from flodl.runtime.cohorts import fork_server
from flodl.runtime.cohorts.control_server import GOODBYE_S, ControlPlane
from flodl.runtime.controller.controller import (
    Controller,
    ControllerResult,
    Exited,
    RunFailed,
)
from flodl.runtime.wire import rank_env
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.store import serve_store

log = logging.getLogger(__name__)

# Lines from a rank's own flodl logging that stay in rank_N.log only.
QUIET_PREFIXES = ("INFO ", "DEBUG ")
_TERM_GRACE_S = GOODBYE_S  # SIGTERM to SIGKILL


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RankProcess:
    """A rank child: its process, its log file and the thread forwarding its output."""

    def __init__(
        self,
        rank: int,
        popen: subprocess.Popen | fork_server.Forked,
        log_path: Path,
        echo: Callable[[str], None],
        label: str | None = None,
    ) -> None:
        self.rank = rank
        self.label = label or f"rank {rank}"
        self.echo = echo
        self.popen = popen
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=20)
        self.forwarder = threading.Thread(target=self._forward, name=f"rank{rank}-out", daemon=True)
        self.forwarder.start()

    def _forward(self) -> None:
        """Copy the rank's output to its log and the console. The rank's pipe is drained to the
        end whatever happens to the log: a full disk stops the log (one warning), never the
        rank (a pipe left unread would block it on its next print)."""
        assert self.popen.stdout is not None
        sink = self._open_log()
        for raw in self.popen.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if sink is not None:
                try:
                    sink.write(line + "\n")
                    sink.flush()
                except OSError as exc:
                    self._log_failed(sink, exc)
                    sink = None
            self.tail.append(line)
            if not line.startswith(QUIET_PREFIXES):
                self.echo(f"[{self.label}] {line}")
        if sink is not None:
            with contextlib.suppress(OSError):
                sink.close()
        self.popen.stdout.close()

    def _open_log(self) -> Any:
        try:
            return open(self.log_path, "a", encoding="utf-8", errors="replace")
        except OSError as exc:
            self._log_failed(None, exc)
            return None

    def _log_failed(self, sink: Any, exc: OSError) -> None:
        from flodl.monitor.failures import write_failure

        self.echo(f"WARNING {write_failure(exc, self.log_path)}; {self.label}'s log file is off")
        if sink is not None:
            with contextlib.suppress(OSError):
                sink.close()

    def last_error_line(self) -> str:
        for line in reversed(self.tail):
            if line.strip() and not line.startswith(QUIET_PREFIXES):
                return line.strip()
        return ""

    def terminate(self) -> None:
        if self.popen.stdin is not None:  # a remote rank's lifeline: EOF = the launcher is done
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                return

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ProcessCohort:
    """Spawn, supervise and tear down one local child process per rank."""

    def __init__(
        self,
        spec: JobSpec,
        controller: Controller,
        job_dir: Path,
        topology: Topology,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.echo = echo or _to_stderr
        self.topology = topology
        self.controller = controller
        self.job_dir = job_dir
        self.plane = ControlPlane(controller)
        self.procs: list[RankProcess] = []
        self._store: Any = None

    @property
    def control_address(self) -> tuple[str, int]:
        return self.plane.address

    def start(self) -> None:
        """Listen, host the store (at the controller's port + 1 when it is fixed), spawn."""
        address = self.spec.config.cluster.controller
        self.plane.listen(address.host, address.port)
        store_port = address.port + 1 if address.port else 0
        self._store = serve_store(address.host, store_port)  # the controller's address only
        self.plane.serve(replace(self.spec, store_host=address.host, store_port=self._store.port))
        for placement in self.topology.placements:
            self.procs.append(self._spawn(placement))
        threading.Thread(target=self._supervise, name="flodl-supervise", daemon=True).start()

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        result = self.controller.run(stop_requested)
        self.plane.await_goodbyes()
        return result

    def lose(self, rank: int) -> None:
        """Take a silent rank down so its loss is certain (its exit is then supervised)."""
        for proc in self.procs:
            if proc.rank == rank:
                proc.kill()

    def outputs(self) -> list[Path]:
        return [proc.log_path for proc in self.procs]

    def stop(self, failure: BaseException | None) -> None:
        """Stop every rank: SIGTERM, a grace period, then SIGKILL. Idempotent."""
        if failure is not None:
            self.plane.abort(failure)
        self.plane.close()
        for proc in self.procs:
            proc.terminate()
        deadline = time.monotonic() + _TERM_GRACE_S
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.popen.wait()
            proc.forwarder.join(timeout=2.0)
        self._store = None

    # -- processes -------------------------------------------------------------------------------
    def _command(self, place: Placement, controller: str) -> tuple[list[str], dict | None, bool]:
        """(argv, environment, lifeline) of one rank's child on this host."""
        entry = self.spec.entry or ["-m", "flodl.runtime.rank"]
        env = rank_env.child_env(
            place.rank, self.spec.world_size, controller, place.device, place.gpu
        )
        return [sys.executable, "-u", *entry], env, False

    def _spawn(self, place: Placement) -> RankProcess:
        host, port = self.plane.address
        argv, env, lifeline = self._command(place, f"{host}:{port}")
        cwd = self._cwd(place)
        popen = self._warm(argv, env, lifeline, cwd) or self._popen(argv, env, lifeline, cwd=cwd)
        log_path = self.job_dir / f"rank_{place.rank}.log"
        return RankProcess(place.rank, popen, log_path, self.echo, place.label)

    def _cwd(self, place: Placement) -> str | None:
        return None

    def _warm(
        self, argv: list[str], env: dict | None, lifeline: bool, cwd: str | None
    ) -> fork_server.Forked | None:
        """A fork of the fork server (:mod:`~flodl.runtime.cohorts.fork_server`) for a plain local
        CPU rank: the managed entry, no lifeline, no working directory of its own; else None (start
        cold)."""
        plain = argv == [sys.executable, "-u", "-m", "flodl.runtime.rank"]
        if not plain or env is None or lifeline or cwd is not None:
            return None
        if env.get(rank_env.DEVICE, "cpu") != "cpu":
            return None  # a GPU rank's CUDA_VISIBLE_DEVICES must be set before it starts
        return fork_server.take(env, self.plane.secret)

    def _popen(
        self, argv: list[str], env: dict | None, lifeline: bool, cwd: str | None = None
    ) -> subprocess.Popen:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: teardown reaches its children too
        )
        assert popen.stdin is not None
        popen.stdin.write(self.plane.secret.hex().encode() + b"\n")
        popen.stdin.flush()
        if not lifeline:
            popen.stdin.close()
            popen.stdin = None
        return popen

    def _supervise(self) -> None:
        pending = {p.rank: p for p in self.procs}
        while pending and not self.plane.closing:
            for rank, proc in list(pending.items()):
                code = proc.popen.poll()
                if code is None:
                    continue
                proc.forwarder.join(timeout=2.0)
                self.controller.post(rank, Exited(code, proc.last_error_line()))
                del pending[rank]
            time.sleep(0.05)


__all__ = ["ProcessCohort", "RankProcess", "RunFailed"]
