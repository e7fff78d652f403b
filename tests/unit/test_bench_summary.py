"""bench/render.py writes the root README's benchmark summary from the result files."""

from __future__ import annotations

import re
from pathlib import Path

from bench.render import _load, readme_summary_block

ROOT = Path(__file__).resolve().parents[2]


def _hetero(rows):
    return {
        "machine": {"cores": 2, "cpu": "AMD EPYC", "torch": "2.13.0+cpu", "date": "today",
                    "load_average": [0.5, 1.25, 0.75]},
        "settings": {"workload": "lenet", "dataset": "mnist5k", "batch_size": 64, "epochs": 4,
                     "pace_margin": 1.3, "repeats": 3},
        "command": "python -m bench.hetero",
        "rows": rows,
    }  # fmt: skip


def _row(variant, sps, idle, **extra):
    return {"speeds": [1.0, 0.4], "variant": variant, "samples_per_s": sps, "efficiency": 0.5,
            "efficiency_T_matched": 0.6, "vs_ddp": 1.5, "vs_ddp_T_matched": 1.7,
            "test_accuracy": 0.95, "syncs": 8, "idle_fraction": idle, **extra}  # fmt: skip


def test_the_summary_quotes_the_hetero_rows_and_the_overhead() -> None:
    rows = [
        _row("solo_fast", 2473.2, [0.0]),
        _row("solo_slow", 965.4, [0.0]),
        _row("ddp", 1988.0, [0.6, 0.01]),
        _row("nccl_cadence", 3290.0, [0.01, 0.024]),
    ]
    overhead = {
        "settings": {"repeats": 9},
        "machine": {"date": "then"},
        "rows": [
            {"model": "lenet", "threads": 1, "train_ratio": 1.0656, "train_ratio_of_mins": 1.1}
        ],
    }
    block = readme_summary_block(_hetero(rows), overhead)
    assert block.startswith("Machine: 2-core AMD EPYC VM, torch 2.13.0+cpu, today, load average ")
    assert "0.5\u20131.2 at the start" in block  # min-max of the load averages
    assert (
        "| [1.0, 0.4] | **nccl_cadence** | 3290 | 0.50 | 0.60 | 1.50 | 1.70 | 0.950 | 8 |" in block
    )
    assert "| [1.0, 0.4] | torch DDP (gloo) | 1988 |" in block and "solo_fast |" not in block
    assert "Solo on the fast device: 2473 samples/s, on the slow one 965;" in block
    assert "(the fast rank idles 60% of the time)" in block and "(idle \u2264 2%)" in block
    assert "lenet 1.066 (ratio of best runs 1.100)" in block
    assert readme_summary_block(None, None).startswith("_No results yet")


def test_the_readme_holds_what_the_result_files_render() -> None:
    """Re-render after a bench run (``python -m bench.render``): the README is never typed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(
        r"<!-- bench_summary:begin -->\n(.*?)\n<!-- bench_summary:end -->", text, re.S
    )
    assert found is not None
    assert found.group(1) == readme_summary_block(_load("hetero"), _load("overhead"))
