"""The control plane's server: one component every cohort that starts or hosts ranks composes.

It listens, authenticates each peer with the run's secret (mutual HMAC, :mod:`channel`), admits
it as the rank its ``Hello`` names, sends it the job, and relays its messages to the controller.
Rejected peers are logged at most once a minute per address. Teardown tells every rank that
still listens why the run ended (:meth:`ControlPlane.abort`) before the channels close.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from flodl.runtime.controller.controller import Controller, Disconnected, RunFailed
from flodl.runtime.wire import shm
from flodl.runtime.wire.channel import AuthError, Channel, Listener, new_secret
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.messages import Abort, Hello

log = logging.getLogger(__name__)

GOODBYE_S = 5.0  # how long ranks get to close their channels (and exit) after a stop
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


class ControlPlane:
    """Listen, admit authenticated ranks, hand them the job, relay their messages."""

    def __init__(self, controller: Controller, secret: bytes | None = None) -> None:
        self.controller = controller
        self.secret = secret or new_secret()
        self.listener: Listener | None = None
        self.own_ranks: set[int] = set()  # ranks that train inside this very process
        self._spec: JobSpec | None = None
        self._channels: list[Channel] = []
        self._channel_of: dict[int, Channel] = {}
        self._reading: set[int] = set()  # ranks whose control channel is still open
        self._closing = False
        self._rejects = RejectLog()
        self._shm_pids: set[int] = set()  # same-host ranks whose channel uses /dev/shm

    @property
    def address(self) -> tuple[str, int]:
        """Where the plane listens: ``(host, port)``."""
        assert self.listener is not None, "listen() first"
        return self.listener.host, self.listener.port

    @property
    def closing(self) -> bool:
        return self._closing

    def listen(self, host: str, port: int = 0) -> tuple[str, int]:
        self.listener = Listener(host, port)
        return self.address

    def serve(self, spec: JobSpec) -> None:
        """Admit ranks from now on; each gets ``spec`` (frozen: what every rank trains)."""
        self._spec = spec
        threading.Thread(target=self._accept_loop, name="flodl-accept", daemon=True).start()

    def abort(self, exc: BaseException) -> None:
        """The run failed: tell every rank process why before teardown closes its channel, so
        the survivors exit quietly instead of reporting a lost control channel."""
        from flodl.monitor.failures import describe

        reason = str(exc) if isinstance(exc, RunFailed) else describe(exc)
        for rank, channel in list(self._channel_of.items()):
            if rank in self.own_ranks:  # trains in this very process: never told to exit
                continue
            try:
                channel.send(Abort(reason or "stopped"))
            except (OSError, ValueError):
                pass

    def await_goodbyes(self, timeout_s: float = GOODBYE_S) -> None:
        """After a normal stop, let every rank close its channel itself before teardown closes
        ours: a rank placed by torchrun or SLURM must see a goodbye, not a lost controller (its
        exit code is what that launcher reports)."""
        deadline = time.monotonic() + timeout_s
        while self._reading and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """Stop admitting and close every channel. Idempotent."""
        self._closing = True
        for channel in self._channels:
            channel.close()
        if self.listener is not None:
            self.listener.close()
        for pid in self._shm_pids:  # names a killed rank left in /dev/shm (the run is over)
            shm.sweep(pid)
        self._shm_pids.clear()

    def _accept_loop(self) -> None:
        assert self.listener is not None
        while not self._closing:
            try:
                sock = self.listener.accept(timeout_s=0.5)
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: Any) -> None:
        assert self._spec is not None
        channel = Channel(sock)
        try:
            channel.authenticate_as_server(
                self.secret, shared_memory=self.controller.cfg.cluster.shared_memory
            )
            hello = channel.recv()
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self._spec.world_size:
                raise AuthError(f"unexpected first message {type(hello).__name__}")
            if hello.rank in self._channel_of:  # a rank connects once: a dropped one stays out
                raise AuthError(f"rank {hello.rank} already joined this run (or was dropped)")
        except (AuthError, OSError, EOFError, ValueError) as exc:
            self._rejects.rejected(_peer_address(sock), exc)
            channel.close()
            return
        self._channels.append(channel)
        self._channel_of[hello.rank] = channel
        if channel.shm is not None and hello.pid != os.getpid():
            self._shm_pids.add(hello.pid)  # its /dev/shm names are swept at teardown
        self._reading.add(hello.rank)
        self.controller.attach(hello.rank, channel)
        channel.send_code(self._spec)
        try:
            self._read(hello.rank, channel)
        finally:
            self._reading.discard(hello.rank)

    def _read(self, rank: int, channel: Channel) -> None:
        while True:
            try:
                msg = channel.recv(route=self.controller.route)  # cpu_*: snapshots summed
            except (OSError, EOFError, ConnectionError) as exc:
                if not self._closing and not channel.closed:
                    self.controller.post(rank, Disconnected(str(exc) or type(exc).__name__))
                return
            if channel.closed:  # the controller dropped this rank: nothing it sends counts
                return
            self.controller.post(rank, msg)


def _peer_address(sock: Any) -> str:
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError, TypeError):
        return "unknown"
