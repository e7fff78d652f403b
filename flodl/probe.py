"""``python -m flodl probe``: is this host ready to run a flodl cohort?

Checks what a launch needs before any rank starts: the devices (via ``nvidia-smi``, CUDA
untouched), torch and its CUDA/NCCL build, Python and flodl versions, that the controller port can
be bound, and that the data path is readable. Prints a table, or JSON with ``--json``; exits 0
when ready and 1 with the reasons when not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    host: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))


_TORCH_FACTS = (
    "import json, torch, torch.distributed as d;"
    "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,"
    " 'gloo': d.is_gloo_available(), 'nccl': d.is_nccl_available()}))"
)


def _torch_facts() -> dict[str, Any]:
    """Ask a child interpreter, so this process never loads torch (or a CUDA context)."""
    out = subprocess.run(
        [sys.executable, "-c", _TORCH_FACTS], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "no output")
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return facts


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def probe(host: str = "127.0.0.1", port: int = 0, data_path: str | None = None) -> Report:
    """Run every local check."""
    from flodl import __version__
    from flodl.sys import detect_gpus

    report = Report(host=socket.gethostname())
    report.facts.update(python=platform.python_version(), flodl=__version__)
    gpus = detect_gpus()
    report.facts["gpus"] = [f"{g.index}: {g.name} ({g.total_memory_mb} MB)" for g in gpus]
    report.add("devices", True, f"{len(gpus)} GPU(s)" if gpus else "no GPU: CPU ranks (gloo)")
    try:
        facts = _torch_facts()
        report.facts.update(facts)
        report.add(
            "torch",
            facts["gloo"] or facts["nccl"],
            f"torch {facts['torch']}, CUDA {facts['cuda']}, gloo {facts['gloo']}, "
            f"nccl {facts['nccl']}",
        )
        if gpus and not facts["nccl"]:
            report.add(
                "nccl", False, "GPUs visible but this torch has no NCCL: install a CUDA build"
            )
    except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        report.add("torch", False, f"torch does not import: {exc}")
    if port:
        free = _port_free(host, port)
        report.add("controller port", free, f"{host}:{port} " + ("free" if free else "in use"))
    if data_path is not None:
        readable = os.access(data_path, os.R_OK) and Path(data_path).exists()
        report.add("data path", readable, f"{data_path} " + ("readable" if readable else "missing"))
    return report


def render(report: Report) -> str:
    lines = [f"flodl probe — {report.host}"]
    width = max(len(c.name) for c in report.checks) if report.checks else 8
    for check in report.checks:
        mark = "ok  " if check.ok else "FAIL"
        lines.append(f"  {mark} {check.name:<{width}}  {check.detail}")
    for gpu in report.facts.get("gpus", []):
        lines.append(f"       gpu {gpu}")
    lines.append("ready" if report.ready else "NOT ready")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flodl probe", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--host", default="127.0.0.1", help="address the controller would bind")
    parser.add_argument("--port", type=int, default=0, help="controller port to check (0: skip)")
    parser.add_argument("--data-path", default=None, help="a path every rank must read")
    args = parser.parse_args(argv)
    report = probe(args.host, args.port, args.data_path)
    if args.json:
        data = {
            "host": report.host,
            "ready": report.ready,
            "facts": report.facts,
            "checks": [asdict(c) for c in report.checks],
        }
        print(json.dumps(data, indent=2))
    else:
        print(render(report))
    return 0 if report.ready else 1
