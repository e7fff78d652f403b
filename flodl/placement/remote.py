"""Reaching worker hosts with the OpenSSH client: the command lines, and what a host reports.

Every remote command runs as ``ssh -T -o BatchMode=yes`` with keep-alives: no terminal, no
password prompt that would hang a launch, and a dead link noticed within ~15 s. The remote
command is a plain ``sh`` line built with :func:`shlex.quote`; secrets never appear in it (a rank's
secret goes to its stdin).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flodl.config import ConfigError, WorkerConfig

_KEEPALIVE = ("-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")

# Run on the host by its own Python: versions and GPUs, without importing torch (fast, no CUDA).
_FACTS = (
    "import json, platform, flodl, flodl.placement.gpus as s; g = s.detect_gpus(); "
    "print(json.dumps({'python': platform.python_version(), 'flodl': flodl.__version__, "
    "'gpu_indices': [x.physical_index if x.physical_index is not None else x.index for x in g], "
    "'gpus': [f'{x.index}: {x.name} ({x.total_memory_mb} MB)' for x in g]}))"
)


def ssh_argv(worker: WorkerConfig, remote_command: str) -> list[str]:
    """``ssh`` argv that runs ``remote_command`` (one sh line) on the worker's host."""
    ssh = worker.ssh
    if ssh is None:
        raise ValueError(f"worker {worker.host} has no ssh section")
    argv = ["ssh", "-T", "-o", "BatchMode=yes", *_KEEPALIVE]
    argv += ["-o", f"ConnectTimeout={max(1, round(ssh.connect_timeout_s))}"]
    if ssh.config_file:
        argv += ["-F", os.path.expanduser(ssh.config_file)]
    if ssh.identity_file:
        argv += ["-i", os.path.expanduser(ssh.identity_file)]
    if ssh.port:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    for key, value in ssh.options.items():
        argv += ["-o", f"{key}={value}"]
    argv += [ssh.target or worker.host, "--", remote_command]
    return argv


def shell_line(worker: WorkerConfig, env: dict[str, str], argv: list[str]) -> str:
    """``cd <project> && exec env K=V ... <python> <argv>`` for the host's shell."""
    cwd = worker.project_path or os.getcwd()
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    cmd = " ".join(shlex.quote(a) for a in [worker.python, *argv])
    return f"cd {shlex.quote(cwd)} && exec env {assigns} {cmd}"


def worker_env(worker: WorkerConfig) -> dict[str, str]:
    """What a worker's ranks get besides their role: its env, its sockets' interface."""
    env = dict(worker.env)
    if worker.nccl_socket_ifname:
        env.setdefault("NCCL_SOCKET_IFNAME", worker.nccl_socket_ifname)
        env.setdefault("GLOO_SOCKET_IFNAME", worker.nccl_socket_ifname)
    return env


def run_on(worker: WorkerConfig, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``python argv`` on the worker (over ssh, or here for a local worker); capture text."""
    if worker.remote:
        line = shell_line(worker, worker_env(worker), argv)
        cmd = ssh_argv(worker, line)
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    env = {**os.environ, **worker_env(worker)}
    python = sys.executable if worker.python == "python3" else worker.python
    return subprocess.run(
        [python, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=worker.project_path,
        stdin=subprocess.DEVNULL,
    )


def last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def host_facts(worker: WorkerConfig) -> dict[str, Any]:
    """Python and flodl versions and the GPUs of the worker's host; raise on an unusable host."""
    timeout = (worker.ssh.connect_timeout_s if worker.ssh else 10.0) + 60.0
    try:
        out = run_on(worker, ["-c", _FACTS], timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise RuntimeError(str(exc)) from None
    if out.returncode == 255 and worker.remote:
        raise RuntimeError(f"unreachable over ssh: {last_line(out.stderr) or 'exit 255'}")
    if out.returncode != 0:
        why = last_line(out.stderr) or f"exit {out.returncode}"
        raise RuntimeError(f"{worker.python} cannot run flodl there: {why}")
    facts: dict[str, Any] = json.loads(last_line(out.stdout))
    return facts


def host_facts_all(workers: list[WorkerConfig]) -> dict[int, dict[str, Any]]:
    """Ask every worker host at once; one :class:`ConfigError` naming every host that failed."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(workers)))) as pool:
        futures = {i: pool.submit(host_facts, w) for i, w in enumerate(workers)}
    facts: dict[int, dict[str, Any]] = {}
    problems = []
    for i, future in futures.items():
        try:
            facts[i] = future.result()
        except Exception as exc:
            problems.append(f"cluster.workers.{i} ({workers[i].host}): {exc}")
    if problems:
        raise ConfigError("; ".join(problems))
    return facts
