"""One TensorBoard for the whole cluster, served from the launcher (``logger.serve=PORT``).

TensorBoard runs as a child process in its own session rather than in a thread: an in-process
server cannot be stopped reliably (its werkzeug loop and reload threads outlive ``shutdown``),
while a process group can always be killed. The child also watches its parent and exits when the
launcher dies, so even a ``kill -9`` of the launcher leaves no server holding the port.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

_READY_TIMEOUT_S = 60.0
_STOP_GRACE_S = 5.0
_WILDCARDS = {"", "0.0.0.0", "::"}

# Runs in the child: exit as soon as the launcher is gone (reparenting changes getppid), then
# hand over to TensorBoard's own entry point with the remaining arguments.
_CHILD = """
import os, sys, threading, time
parent = int(sys.argv[1])
def _watch():
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
threading.Thread(target=_watch, daemon=True).start()
sys.argv = ["tensorboard", *sys.argv[2:]]
from tensorboard.main import run_main
run_main()
"""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind_probe(host: str, port: int) -> int:
    """Bind and release ``host:port`` (0: any port); return the port. Raises a clear OSError."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR mirrors what the server itself sets, so only a live listener conflicts,
        # not TIME_WAIT leftovers of a previous dashboard.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"logger.serve={port}: port already in use on {host}") from None
            raise OSError(f"logger.host={host}: cannot serve on this address ({exc})") from None
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port``."""
    try:
        _bind_probe(host, port)
    except OSError:
        return True
    return False


class Dashboard:
    """A running TensorBoard over ``logdir``; create it with :meth:`start`.

    ``url`` is what to open in a browser; ``host``, ``port`` and ``pid`` describe the server.
    """

    def __init__(self, proc: subprocess.Popen[bytes], log: IO[bytes], host: str, port: int):
        self._proc: subprocess.Popen[bytes] | None = proc
        self._log = log
        self.pid = proc.pid
        self.host = host
        self.port = port
        shown = socket.getfqdn() if host in _WILDCARDS else host
        shown = f"[{shown}]" if ":" in shown else shown
        self.url = f"http://{shown}:{port}/"
        # A launcher that forgets stop() (an exception between start and the with-block)
        # still takes the server down at interpreter exit.
        atexit.register(self.stop)

    @classmethod
    def start(cls, logdir: Path, port: int, host: str = "127.0.0.1") -> Dashboard:
        """Serve ``logdir`` on ``host:port`` (``port=0``: any free port); wait until it answers.

        Raises OSError before starting anything when the port is taken or the host is not an
        address of this machine; RuntimeError/TimeoutError with TensorBoard's output when the
        server exits or stays silent for 60 s.
        """
        port = _bind_probe(host, port)
        cmd = [
            sys.executable,
            "-c",
            _CHILD,
            str(os.getpid()),
            *("--logdir", str(logdir), "--port", str(port), "--host", host),
            *("--reload_interval", "2", "--load_fast", "false"),
        ]
        # An anonymous temp file, not a pipe: nobody drains a pipe while TensorBoard runs, and
        # a full pipe would block the server. Read only to explain a failed start; it lives as
        # long as the server, so stop() closes it rather than a with-block.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        dashboard = cls(proc, log, host, port)
        try:
            dashboard._wait_ready(_READY_TIMEOUT_S)
        except BaseException:
            dashboard.stop()
            raise
        return dashboard

    def _probe_url(self) -> str:
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/data/logdir"

    def _wait_ready(self, timeout_s: float) -> None:
        # No proxies: an http_proxy in the environment must not intercept a loopback probe.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise RuntimeError(f"TensorBoard exited with code {code}:\n{self.output_tail()}")
            try:
                with opener.open(self._probe_url(), timeout=2.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(
            f"TensorBoard did not answer on {self.url} within {timeout_s:.0f} s:\n"
            f"{self.output_tail()}"
        )

    def output_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters TensorBoard printed (for error messages)."""
        with contextlib.suppress(OSError, ValueError):
            self._log.seek(0)
            return self._log.read().decode(errors="replace")[-limit:]
        return ""

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Terminate the server and everything it started; idempotent, waits for the exit."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
