"""Two real gloo processes running one test module's rank function (``python -m MODULE RDV OUT
RANK``): for tests of collectives that must cross a real process boundary. Rank 0 writes its
result as JSON to OUT; the caller reads it back."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_two_ranks(module: str, timeout_s: float = 120.0) -> Any:
    """Start ``module`` as ranks 0 and 1, wait for both to exit 0, return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, f"file://{Path(tmp) / 'rdv'}", str(out)]
        ranks = [subprocess.Popen([*cmd, str(r)]) for r in (0, 1)]
        try:
            assert [p.wait(timeout=timeout_s) for p in ranks] == [0, 0]
        finally:
            for p in ranks:
                p.kill()
        return json.loads(out.read_text())


def write_result(rank: int, out: str, result: Any) -> None:
    if rank == 0:
        Path(out).write_text(json.dumps(result))
