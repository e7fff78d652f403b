"""The frozen-rank stress: a rank frozen (SIGSTOP) mid-collective, many times, beside a busy core.

    python -m bench.chaos.frozen_stress                    # 40 runs, nccl_cadence, 3 ranks
    python -m bench.chaos.frozen_stress --runs 5 --no-busy

Each run is one ``bench/chaos/run_one.py`` process with ``FLODL_CHAOS=V:average:2:stop``: rank V
(0, 1, 2 in turn) freezes once the second averaging collective is entered, alive but silent, so
the survivors are blocked in a collective on it until the heartbeat declares it lost and they
regroup (flodl/runtime/sync/groups.py). A run is classified as in the chaos matrix (``completed``,
``stopped``, ``hang``, ``broken``), and ``not-started`` when the ranks' start-up outlasted its
timeout (60 s here) before anything was frozen. One core is kept busy (a spinning child) for the
whole stress, as in the stress of the first elastic fix. Not part of ``make test`` (~40 min).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.chaos.matrix import classify, run_faulted

RESULT = Path(__file__).with_name("frozen_result.json")


def run_once(mode: str, victim: int, timeout_s: float, epochs: int, start_s: float) -> dict:
    """One frozen-rank run in its own process; its verdict and wall time."""
    with tempfile.TemporaryDirectory(prefix="flodl-frozen-") as tmp:
        cmd = [sys.executable, "-m", "bench.chaos.run_one", "--mode", mode, "--ranks", "3"]
        cmd += ["--faults", f"{victim}:average:2:stop", "--epochs", str(epochs)]
        cmd += ["--job-dir", str(Path(tmp) / "job"), "--timeout", str(timeout_s)]
        cmd += ["--start-timeout", str(start_s)]
        t0 = time.perf_counter()
        out, timed_out, tail = run_faulted(cmd, tmp, timeout_s)
        verdict = classify(out, {victim}, ckpt=False, timed_out=timed_out)
        if "did not get ready" in str((out or {}).get("summary_error")):
            verdict = "not-started"  # the ranks' start-up outlasted its timeout: nothing frozen
        wall = round(time.perf_counter() - t0, 1)
        return {"victim": victim, "verdict": verdict, "wall_s": wall, "outcome": out, "tail": tail}


def _line(run: dict) -> dict:
    """What one run printed: its verdict, and why when it did not complete."""
    line = {k: run[k] for k in ("victim", "verdict", "wall_s")}
    if run["verdict"] != "completed":
        out = run["outcome"] or {}
        line["why"] = (out.get("summary_error") or out.get("error") or " ".join(run["tail"]))[:300]
    return line


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--mode", default="nccl_cadence")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--no-busy", action="store_true", help="no spinning core beside")
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    busy = None if args.no_busy else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    runs: list[dict] = []
    try:
        for i in range(args.runs):
            runs.append(run_once(args.mode, i % 3, args.timeout, args.epochs, args.start_timeout))
            print(json.dumps(_line(runs[-1])), flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    counts = Counter(r["verdict"] for r in runs)
    record = {"mode": args.mode, "ranks": 3, "busy_core": busy is not None, "counts": counts}
    Path(args.out).write_text(json.dumps({**record, "runs": runs}, indent=1) + "\n")
    print(json.dumps(record), flush=True)
    return 0 if counts["completed"] == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
