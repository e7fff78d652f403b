"""A communication-heavy rig: the hetero benchmark on a 12.7 M-parameter MLP at batch 16.

    .venv/bin/python -m bench.comm_heavy          # 3 interleaved repeats -> comm_heavy.json
    .venv/bin/python -m bench.comm_heavy --quick  # 1 repeat, 1 epoch -> comm_heavy_quick.json

LeNet's 62 k parameters make one all-reduce a sliver of a step, so every mode looks good. Here
(``mlp_wide``: 784 -> 16000 -> 10, Adam) one all-reduce of the parameters is a large share of a
step; the run measures that share (the ``nccl_cadence`` run's mean averaging time against its
nominal step) and plots the anchor and the sync overhead per window, against
``elche.overhead_target``, to show where the auto-tune settles. Rows have hetero.json's shape
(``speeds``, ``variant``, ``samples_per_s``, ``vs_ddp``, ``efficiency``); further arguments go to
``bench.hetero`` (``--rigs``, ``--variants``, ``--timeout``, ...).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench import hetero
from bench.common import RESULTS, log, median, write_result

WORKLOAD, BATCH = "mlp_wide", 16


def allreduce_fraction(data: dict[str, Any]) -> float | None:
    """One parameter all-reduce over (step + all-reduce), from the nccl_cadence runs."""
    fractions = []
    for row in data["rows"]:
        if row["variant"] != "nccl_cadence":
            continue
        for run in row.get("per_repeat") or []:
            if run and run.get("mean_sync_ms") and run.get("nominal_step_ms"):
                sync, step = run["mean_sync_ms"], run["nominal_step_ms"]
                fractions.append(sync / (sync + step))
    return median(fractions)


def plot(data: dict[str, Any], stem: str, target: float = 0.05) -> str | None:
    """Anchor and overhead per window of each nccl_cadence run; the PNG's name, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not any(row["variant"] == "nccl_cadence" for row in data["rows"]):
        return None  # nothing to plot
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    for row in data["rows"]:
        if row["variant"] != "nccl_cadence":
            continue
        for i, run in enumerate(row.get("per_repeat") or []):
            if run and run.get("window_anchor"):
                label = f"{row['speeds']} #{i + 1}"
                top.plot(run["window_anchor"], marker=".", label=label)
                bottom.plot(run["window_overhead"], marker=".", label=label)
    bottom.axhline(target, color="grey", linestyle="--", label="overhead_target")
    top.set_ylabel("anchor (batches)")
    bottom.set_ylabel("sync / compute")
    bottom.set_xlabel("window")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    top.set_title(f"nccl_cadence on {WORKLOAD} (batch {BATCH})")
    name = f"{stem}_anchor.png"
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=90)
    plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stem = "comm_heavy_quick" if "--quick" in argv else "comm_heavy"
    outs = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--out"]
    if outs:  # the caller's name (hetero takes the last --out): annotate that file, not ours
        stem = outs[-1]
    args = ["--workload", WORKLOAD, "--batch-size", str(BATCH), "--out", stem, *argv]
    code = hetero.main(args)
    path = RESULTS / f"{stem}.json"
    if not path.exists():
        return code or 1
    data = json.loads(path.read_text())
    data["benchmark"] = "comm_heavy"
    data["command"] = "python -m bench.comm_heavy " + " ".join(argv)
    data["settings"]["allreduce_fraction"] = allreduce_fraction(data)
    data["settings"]["plot"] = plot(data, stem)
    log(f"one all-reduce = {data['settings']['allreduce_fraction']} of a step")
    log(f"wrote {write_result(stem, data)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
