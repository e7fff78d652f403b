"""Warm rank interpreters: local CPU-rig ranks started before the job is checked.

A rank's start is mostly imports: torch, the worker, and ``torch._dynamo``, which torch.optim
imports on the first optimizer it builds (about 1.3 s of CPU with sympy). The Hydra launcher
spends about as long validating the job (torch, the task's torchmetrics targets, the dry build)
before any rank exists. :func:`start` (called by the Hydra launcher as soon as the first job is
composed) starts the rig's rank interpreters at once, so their imports overlap the launcher's
checks; :class:`~flodl.runtime.launcher.ProcessCohort` then :func:`take` s one per local CPU
rank and writes it its environment (one JSON line) and the secret, as a cold child would get
them at its start. Interpreters left over (a refused job, a smaller cohort) are killed (they
hold nothing yet); they also die with the launcher (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading

WARM_FLAG = "--warm"  # python -m flodl.runtime.rank --warm: import, then wait for the role

_lock = threading.Lock()
_pool: list[subprocess.Popen] = []


def start(n: int) -> None:
    """Start ``n`` warm rank interpreters (in the launcher's environment and import path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    for _ in range(n):
        popen = subprocess.Popen(
            [sys.executable, "-u", "-m", "flodl.runtime.rank", WARM_FLAG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, as a cold rank child
        )
        with _lock:
            _pool.append(popen)


def take(env: dict[str, str], secret: bytes) -> subprocess.Popen | None:
    """A live warm interpreter given ``env`` and ``secret`` (its stdin then closed), or None."""
    while True:
        with _lock:
            if not _pool:
                return None
            popen = _pool.pop(0)
        if popen.poll() is not None:
            continue  # it died while waiting (its output is lost with it): start a cold one
        assert popen.stdin is not None
        try:
            popen.stdin.write(json.dumps(env).encode() + b"\n" + secret.hex().encode() + b"\n")
            popen.stdin.close()
        except OSError:
            continue
        popen.stdin = None
        return popen


def close() -> None:
    """End every interpreter no cohort took (idempotent)."""
    with _lock:
        left = list(_pool)
        _pool.clear()
    for popen in left:  # nothing of a run is in them yet: killed, not asked
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        popen.wait()
        for stream in (popen.stdin, popen.stdout):
            if stream is not None:
                stream.close()


def adopt_role() -> bool:
    """In a warm interpreter: pre-import, then wait for the role. False when the launcher
    closed us unused; True with ``os.environ`` (and ``sys.path``) now the rank's."""
    import torch
    import torch._dynamo

    import flodl.runtime.worker  # noqa: F401

    del torch
    line = sys.stdin.readline()
    if not line.strip():
        return False
    env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)
    for path in env.get("PYTHONPATH", "").split(os.pathsep):
        if path and path not in sys.path:
            sys.path.append(path)
    return True


def pool_size() -> int:
    with _lock:
        return len(_pool)


atexit.register(close)
