"""``python -m flodl probe``: a ready host and an unready one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flodl", "probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_ready_host_json(tmp_path):
    out = run_probe("--json", "--data-path", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ready"] is True
    assert report["facts"]["torch"].startswith("2.") and report["facts"]["gloo"] is True
    names = {c["name"] for c in report["checks"]}
    assert {"devices", "torch", "data path"} <= names


@pytest.mark.slow
def test_unready_host_names_the_reasons(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_probe("--port", str(port), "--data-path", str(tmp_path / "missing"))
    assert out.returncode == 1
    assert "FAIL controller port" in out.stdout and "in use" in out.stdout
    assert "FAIL data path" in out.stdout and "NOT ready" in out.stdout


def test_unknown_command_exits_2():
    from flodl.__main__ import main

    assert main(["frobnicate"]) == 2
