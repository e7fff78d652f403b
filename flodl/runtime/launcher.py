"""Who starts processes: one child per rank, their output, their supervision and teardown.

The launcher hosts the controller (control plane) and the ``TCPStore`` the ranks rendezvous on
(data plane). Children are fresh interpreters (``python -m flodl.runtime.rank``), never forks of
a process that has torch initialised; on a worker host of a cluster file they are started by the
OpenSSH client (:mod:`flodl.remote`). Each child's output goes to ``<job_dir>/rank_N.log`` and,
prefixed ``[rank N]`` (``[host:N]`` for a remote rank), to the console when it is a warning, an
error or the user's own print.

The secret goes to each child's stdin, never to a command line. A remote rank's stdin stays open
as its lifeline: closing it (teardown) or losing the ssh link makes the remote rank exit.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flodl.runtime import env as rank_env
from flodl.runtime.channel import AuthError, Channel, Listener, new_secret
from flodl.runtime.controller import Controller, ControllerResult, Disconnected, Exited, RunFailed
from flodl.runtime.messages import Hello
from flodl.runtime.spec import JobSpec
from flodl.runtime.store import serve_store
from flodl.topology import Placement, Topology

log = logging.getLogger(__name__)

# Lines from a rank's own flodl logging that stay in rank_N.log only.
_QUIET_PREFIXES = ("INFO ", "DEBUG ")
_TERM_GRACE_S = 5.0
_REJECT_LOG_EVERY_S = 60.0  # a connection storm from one address logs one line a minute


class RejectLog:
    """Warn about rejected control-plane peers once per address per interval, with a count of
    the ones not logged, so a storm of bad connections cannot flood the console."""

    def __init__(self, every_s: float = _REJECT_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._lock = threading.Lock()

    def rejected(self, address: str, reason: object, now: float | None = None) -> bool:
        """Record one rejection; returns True when it was logged."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self._last.get(address)
            if last is not None and now - last < self.every_s:
                self._quiet[address] = self._quiet.get(address, 0) + 1
                return False
            self._last[address] = now
            quiet = self._quiet.pop(address, 0)
        more = f" ({quiet} more from it not logged in {self.every_s:.0f} s)" if quiet else ""
        log.warning("rejected a control-plane peer %s: %s%s", address, reason, more)
        return True


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RankProcess:
    """A rank child: its process, its log file and the thread forwarding its output."""

    def __init__(
        self,
        rank: int,
        popen: subprocess.Popen,
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
        assert self.popen.stdout is not None
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as sink:
            for raw in self.popen.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                sink.write(line + "\n")
                sink.flush()
                self.tail.append(line)
                if not line.startswith(_QUIET_PREFIXES):
                    self.echo(f"[{self.label}] {line}")
        self.popen.stdout.close()

    def last_error_line(self) -> str:
        for line in reversed(self.tail):
            if line.strip() and not line.startswith(_QUIET_PREFIXES):
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


class ProcessLauncher:
    """Spawn, authenticate, supervise and tear down a cohort of rank processes."""

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
        self.secret = new_secret()
        self.procs: list[RankProcess] = []
        self.channels: list[Channel] = []
        self._reading: set[int] = set()  # ranks whose control channel is still open
        self._channel_of: dict[int, Channel] = {}
        self.own_ranks: set[int] = set()  # ranks that train inside the launcher's process
        self._closing = False
        self._rejects = RejectLog()
        controller.hooks.kill_rank = self.kill_rank

    def kill_rank(self, rank: int) -> None:
        """Take a silent rank down so its loss is certain (its exit is then supervised)."""
        for proc in self.procs:
            if proc.rank == rank:
                proc.kill()

    def open_planes(self) -> Any:
        """Listen for the control plane and host the data plane's store; returns the store."""
        address = self.spec.config.cluster.controller
        self.listener = Listener(address.host, address.port)
        self.control_address = (self.listener.host, self.listener.port)
        store_port = address.port + 1 if address.port else 0
        store = serve_store(address.host, store_port)  # bound to the controller's address only
        self.spec.store_host, self.spec.store_port = address.host, store.port
        return store

    def run(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        store = self.open_planes()
        try:
            threading.Thread(target=self._accept_loop, name="flodl-accept", daemon=True).start()
            for placement in self.topology.placements:
                self.procs.append(self._spawn(placement))
            threading.Thread(target=self._supervise, name="flodl-supervise", daemon=True).start()
            result = self.controller.run(stop_requested)
            self.await_goodbyes()
            return result
        except BaseException as exc:
            self.abort(exc)
            raise
        finally:
            self.shutdown()
            del store

    def abort(self, exc: BaseException) -> None:
        """The run failed: tell every rank process why before teardown closes its channel, so
        the survivors exit quietly instead of reporting a lost control channel."""
        from flodl.failures import describe
        from flodl.runtime.messages import Abort

        reason = str(exc) if isinstance(exc, RunFailed) else describe(exc)
        for rank, channel in list(self._channel_of.items()):
            if rank in self.own_ranks:  # trains in this very process: never told to exit
                continue
            try:
                channel.send(Abort(reason or "stopped"))
            except (OSError, ValueError):
                pass

    def await_goodbyes(self, timeout_s: float = _TERM_GRACE_S) -> None:
        """After a normal stop, let every rank close its channel itself before teardown closes
        ours: a rank placed by torchrun or SLURM must see a goodbye, not a lost controller (its
        exit code is what that launcher reports)."""
        deadline = time.monotonic() + timeout_s
        while self._reading and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, place: Placement) -> RankProcess:
        controller = f"{self.listener.host}:{self.listener.port}"
        entry = self.spec.entry or ["-m", "flodl.runtime.rank"]
        workers = self.spec.config.cluster.workers
        worker = workers[place.worker] if place.worker is not None else None
        if worker is not None and worker.remote:
            from flodl import remote

            env = {
                **remote.worker_env(worker),
                **rank_env.role_env(
                    place.rank, self.spec.world_size, controller, place.device, place.gpu
                ),
                rank_env.LIFELINE: "1",
            }
            argv = remote.ssh_argv(worker, remote.shell_line(worker, env, ["-u", *entry]))
            popen = self._popen(argv, None, lifeline=True)
        else:
            env = rank_env.child_env(
                place.rank, self.spec.world_size, controller, place.device, place.gpu
            )
            if worker is not None:
                from flodl import remote

                env.update(remote.worker_env(worker))
            python = sys.executable
            if worker is not None and worker.python != "python3":
                python = worker.python
            cwd = worker.project_path if worker is not None else None
            popen = self._popen([python, "-u", *entry], env, lifeline=False, cwd=cwd)
        log_path = self.job_dir / f"rank_{place.rank}.log"
        return RankProcess(place.rank, popen, log_path, self.echo, place.label)

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
        popen.stdin.write(self.secret.hex().encode() + b"\n")
        popen.stdin.flush()
        if not lifeline:
            popen.stdin.close()
            popen.stdin = None
        return popen

    def _supervise(self) -> None:
        pending = {p.rank: p for p in self.procs}
        while pending and not self._closing:
            for rank, proc in list(pending.items()):
                code = proc.popen.poll()
                if code is None:
                    continue
                proc.forwarder.join(timeout=2.0)
                self.controller.post(rank, Exited(code, proc.last_error_line()))
                del pending[rank]
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Stop every rank: SIGTERM, a grace period, then SIGKILL. Idempotent."""
        self._closing = True
        for channel in self.channels:
            channel.close()
        self.listener.close()
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

    # -- control plane -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock = self.listener.accept(timeout_s=0.5)
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: Any) -> None:
        channel = Channel(sock)
        try:
            channel.authenticate_as_server(self.secret)
            hello = channel.recv()
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self.spec.world_size:
                raise AuthError(f"unexpected first message {type(hello).__name__}")
        except (AuthError, OSError, EOFError, ValueError) as exc:
            self._rejects.rejected(_peer_address(sock), exc)
            channel.close()
            return
        self.channels.append(channel)
        self._channel_of[hello.rank] = channel
        self._reading.add(hello.rank)
        self.controller.attach(hello.rank, channel)
        channel.send_code(self.spec)
        try:
            self._read(hello.rank, channel)
        finally:
            self._reading.discard(hello.rank)

    def _read(self, rank: int, channel: Channel) -> None:
        while True:
            try:
                msg = channel.recv(route=self.controller.route)  # cpu_*: snapshots summed
            except (OSError, EOFError, ConnectionError) as exc:
                if not self._closing:
                    self.controller.post(rank, Disconnected(str(exc) or type(exc).__name__))
                return
            self.controller.post(rank, msg)


def _peer_address(sock: Any) -> str:
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return "unknown"


__all__ = ["ProcessLauncher", "RankProcess", "RunFailed"]
