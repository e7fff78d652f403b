"""A warm fork server for local CPU ranks: torch imported once, each rank a fork of it.

A rank's start is mostly imports: torch, the worker, and ``torch._dynamo``, which the first
``optimizer.step()`` imports (with sympy): about 4 s of CPU, paid again by every rank of every
run. The fork server (one interpreter per launcher process, :func:`start`) pays it once: it
imports all that, then waits on a Unix socket; :func:`take` asks it to fork a rank, hands the
child its environment, working directory, secret and an output pipe, and returns a
:class:`Forked` that the cohort supervises as it would a :class:`subprocess.Popen` (pid, poll,
wait, the output to forward). Nothing of a run is ever in the server: it has run no torch op, no
thread pool and no process group (forking is safe, as for DataLoader workers); each child
becomes exactly what a cold ``python -m flodl.runtime.rank`` would be, with its own session
(the cohort's ``killpg`` reaches its loader workers) and ``PR_SET_PDEATHSIG`` on the server.

The server reaps its children and reports each exit code over the socket. It lives as long as
the launcher process (the next run, the next job of a sweep, forks from it at once): when the
launcher closes it or dies, the socket ends and the server kills what it forked, then exits.
``FLODL_FORK_SERVER=0`` turns it off (every rank is then a cold interpreter); a server that
cannot start or dies is not an error either: :func:`take` returns None and the cohort starts a
cold child.

Used only for a plain local CPU rank (:meth:`ProcessCohort._warm`): a GPU rank's
``CUDA_VISIBLE_DEVICES`` must be set before its interpreter starts, a remote rank starts on its
host, a cooperative rank re-executes the user's script.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings
from typing import IO, Any

log = logging.getLogger(__name__)

RANK_TARGET = "flodl.runtime.rank.process:main"
READY_S = 120.0  # the server's imports, on a busy machine
_REPLY_S = 30.0
_MAX_MESSAGE = 1 << 20
# Variables native libraries read once, when loaded (OpenMP, BLAS, torch, the loader) or the
# interpreter at its start: a fork keeps the server's. A server whose values differ from the
# launcher's now is replaced, so a rank sees what a cold one would.
_LOAD_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "LD_", "PYTHON")
_PER_RANK = ("PYTHONPATH", "PYTHONUNBUFFERED")  # given to each fork (sys.path) or set by us


def _load_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_LOAD_TIME) and k not in _PER_RANK}


class Forked:
    """A rank forked by the server, supervised as a :class:`subprocess.Popen` (the subset the
    cohort uses). Its exit code arrives from the server, which is its parent."""

    stdin = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args = ["flodl.runtime.cohorts.fork_server", str(pid)]
        self.env: dict[str, str] = {}  # what it runs with (its /proc environ is the server's)
        self.stdout: IO[bytes] | None = None
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set()


class _Server:
    """The launcher's end of the fork server: its process, the socket and the reader thread."""

    def __init__(self) -> None:
        self.owner = os.getpid()  # a fork of the launcher must not talk over its socket
        self.load_time_env = _load_time_env()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.popen = subprocess.Popen(
            [sys.executable, "-u", "-m", "flodl.runtime.cohorts.fork_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # a fork's output is its own pipe; the server's failures
            stderr=subprocess.DEVNULL,  # come over the socket (holding no caller's pipe open)
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
        )
        theirs.close()
        self.sock = ours
        self.ready = threading.Event()
        self.dead = False
        self.request_lock = threading.Lock()  # one fork request at a time
        self._replies: queue.Queue[Forked | None] = queue.Queue()
        self._children: dict[int, Forked] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="flodl-fork-server", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "ready" in msg:
                self.ready.set()
            elif "fatal" in msg:
                log.warning("no fork server (%s): ranks start as cold interpreters", msg["fatal"])
            elif "pid" in msg:
                child = Forked(int(msg["pid"]))
                with self._lock:
                    self._children[child.pid] = child
                self._replies.put(child)
            elif "error" in msg:
                log.warning("the fork server could not start a rank: %s", msg["error"])
                self._replies.put(None)
            elif "exit" in msg:
                with self._lock:
                    gone = self._children.pop(int(msg["exit"]), None)
                if gone is not None:
                    gone._exited(int(msg["code"]))
        # The server is gone, so are its children (they die with it: PR_SET_PDEATHSIG).
        self.dead = True
        self.ready.set()
        self._replies.put(None)
        with self._lock:
            left, self._children = list(self._children.values()), {}
        for child in left:
            child._exited(-signal.SIGKILL)

    def fork(self, target: str, env: dict[str, str], secret: bytes) -> Forked | None:
        if not self.ready.wait(READY_S) or self.dead:
            return None
        request = json.dumps(
            {"target": target, "env": env, "cwd": os.getcwd(), "secret": secret.hex()}
        ).encode()
        read_end, write_end = os.pipe()
        with self.request_lock:
            try:
                socket.send_fds(self.sock, [request], [write_end])
                child = self._replies.get(timeout=_REPLY_S)
            except (OSError, queue.Empty) as exc:
                log.warning("the fork server did not answer (%s): starting a cold rank", exc)
                child = None
            finally:
                os.close(write_end)
        if child is None:
            os.close(read_end)
            return None
        child.stdout = os.fdopen(read_end, "rb")
        child.env = env
        return child

    def running(self) -> list[Forked]:
        with self._lock:
            return [c for c in self._children.values() if c.returncode is None]

    def close(self) -> None:
        importing = not self.ready.is_set()  # it has forked nothing: not waited for
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if importing:  # it reads the socket only once its imports are done (~2 s)
            self.popen.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


_lock = threading.Lock()
_server: _Server | None = None
_retired: list[_Server] = []  # replaced while their forks still ran (another run's ranks)


def enabled() -> bool:
    """``FLODL_FORK_SERVER=0``: no fork server, every rank a cold interpreter."""
    return os.environ.get("FLODL_FORK_SERVER", "1") != "0" and sys.platform.startswith("linux")


def start() -> None:
    """Start this process's fork server unless one is up (its imports run meanwhile)."""
    global _server
    if not enabled():
        return
    with _lock:
        if _server is not None and _server.owner != os.getpid():
            _server = None  # we are a fork of the process that owns it: ours is to start
        if _server is not None and not _server.dead:
            if _server.load_time_env == _load_time_env():
                return
            # Started under other load-time settings: a fresh one. One still serving another
            # run's ranks (a second Trainer.run of this process) is closed at exit, not now.
            if _server.running():
                _retired.append(_server)
            else:
                _server.close()
        try:
            _server = _Server()
        except OSError as exc:
            log.warning("no fork server (%s): ranks start as cold interpreters", exc)
            _server = None


def start_for(cluster: Any, placed: bool) -> None:
    """Start the fork server now when ``cluster`` is a local CPU rig (not one torchrun or srun
    ``placed``), so its imports overlap the launcher's own checks and dry build."""
    if serves(cluster, placed):
        start()


def serves(cluster: Any, placed: bool) -> bool:
    """Whether ``cluster``'s ranks fork from this process's server: a local CPU rig of 2+ ranks
    that torchrun or srun did not place."""
    return not placed and cluster.kind == "cpu_rig" and cluster.ranks >= 2


def close_idle() -> None:
    """End the fork server if it serves no rank now (one started on speculation, before the
    job was known, for a job whose ranks do not fork from it)."""
    global _server
    with _lock:
        server = _server
        if server is None or server.owner != os.getpid() or server.running():
            return
        _server = None
    server.close()


def take(env: dict[str, str], secret: bytes, target: str = RANK_TARGET) -> Forked | None:
    """A rank forked from the server (started if need be), running ``target`` ("module:function",
    returning the exit code) with ``env`` as its environment and ``secret`` on its stdin; None
    when there is no server to fork from (the cohort then starts a cold child)."""
    start()
    with _lock:
        server = _server
    return None if server is None else server.fork(target, env, secret)


def forks() -> dict[int, dict[str, str]]:
    """pid -> environment of each fork still running (``/proc/PID/environ`` of a fork shows the
    server's environment, not the one the rank runs with)."""
    with _lock:
        server = _server
    return {} if server is None else {c.pid: c.env for c in server.running()}


def server_pid() -> int | None:
    """The fork server's pid (a long-lived child of this process), if one is up."""
    with _lock:
        if _server is None or _server.dead or _server.owner != os.getpid():
            return None
        return _server.popen.pid


def close() -> None:
    """End the fork server (idempotent); what it forked and still runs is killed."""
    global _server
    with _lock:
        servers = [s for s in (_server, *_retired) if s is not None]
        _server = None
        _retired.clear()
    for server in servers:
        if server.owner == os.getpid():
            server.close()


atexit.register(close)


# -- the server's side: ``python -m flodl.runtime.cohorts.fork_server FD`` --
def _preload() -> None:
    """What every rank imports before its first step (see the module's docstring)."""
    import torch
    import torch._dynamo
    import torch.distributed  # noqa: F401


def _serve(sock: socket.socket) -> None:
    try:
        _preload()
    except Exception:  # told to the launcher, whose ranks then start cold
        sock.send(json.dumps({"fatal": traceback.format_exc(limit=-3)}).encode())
        return
    sock.send(json.dumps({"ready": True}).encode())
    children: set[int] = set()
    while True:
        _reap(sock, children)
        readable, _, _ = select.select([sock], [], [], 0.05)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            break
        try:
            pid = _fork(sock, json.loads(data), fds[0])
        except Exception as exc:  # told to the launcher, which starts a cold rank
            with contextlib.suppress(OSError):
                sock.send(json.dumps({"error": repr(exc)}).encode())
            continue
        finally:
            for fd in fds:
                os.close(fd)
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())
    for pid in children:  # the launcher closed us or died: nothing we forked outlives it
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"exit": pid, "code": code}).encode())


def _fork(sock: socket.socket, request: dict[str, Any], out: int) -> int:
    secret_read, secret_write = os.pipe()
    os.write(secret_write, request["secret"].encode() + b"\n")
    os.close(secret_write)
    server = os.getpid()
    with warnings.catch_warnings():  # 3.12+: numpy's BLAS thread makes fork() warn; none runs
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        _child(sock, request, out, secret_read, server)  # never returns
    os.close(secret_read)
    return pid


def _child(sock: socket.socket, request: dict[str, Any], out: int, stdin: int, server: int) -> None:
    code = 1
    try:
        os.setsid()  # its own process group, as a cold child's: teardown reaches its workers
        from flodl.runtime.rank.process import _die_with_parent

        _die_with_parent()
        if os.getppid() != server:
            os._exit(1)  # the server died between fork and prctl
        sock.close()
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(stdin)
        os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # as ``python -m`` in that directory
        for path in request["env"].get("PYTHONPATH", "").split(os.pathsep):
            if path and path not in sys.path:
                sys.path.append(path)
        if "numpy" in sys.modules:  # its global generator, seeded from entropy as in a new
            sys.modules["numpy"].random.seed()  # interpreter (Python's `random` reseeds itself)
        module, _, function = request["target"].partition(":")
        target = importlib.import_module(module)
        sys.argv = [getattr(target, "__file__", module)]  # as ``python -m module``
        code = int(getattr(target, function)() or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # printed to the rank's log, as an uncaught error would be
        traceback.print_exc()
    from flodl.runtime.rank.process import end_process

    end_process(code)


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    with sock, contextlib.suppress(OSError):  # OSError: the launcher went away (EPIPE)
        _serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
