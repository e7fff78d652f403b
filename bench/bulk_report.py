"""docs/benchmarks/index.md blocks for bench/bulk.py (memory, speed, disk at 120 M parameters) and
bench/big.py (a 120 M model trained, checkpointed and resumed end to end); used by render.py."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def _f(x: Any, fmt: str = ".0f") -> str:
    return "\u2013" if x is None else format(x, fmt)


def _memory(rows: list[dict[str, Any]]) -> str:
    header = [
        "mode",
        "launcher peak MB",
        "bound 1.5 P + 300 MB",
        "met",
        "rank peak MB",
        "rank: extra copies beyond a plain loop (goal <= 2)",
        "same, counted as peak - 4 P",
        "/dev/shm peak MB",
        "wall s",
    ]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        if r.get("mode") == "plain_loop":
            continue  # the reference: in the text above the table
        if r.get("status") != "ok":
            out.append(f"| {r.get('mode', '?')} | failed: {r.get('error', r.get('status'))} |")
            continue
        solo = r["mode"] == "solo"
        cells = [
            "solo (trains in the launcher: held to the rank's rule)" if solo else r["mode"],
            _f(r["launcher_peak_mb"]),
            _f(r["launcher_bound_mb"]),
            "\u2013" if solo else ("yes" if r["launcher_within_bound"] else "no"),
            "\u2013" if solo else _f(r["rank_peak_mb"]),
            _f(r.get("rank_extra_copies"), ".1f"),
            "\u2013" if solo else _f(r.get("rank_over_4p"), ".1f"),
            _f(r.get("shmem_peak_mb")),
            _f(r["wall_s"]),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _runs(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


def _speed(s: dict[str, Any]) -> str:
    if "round_s" in s:  # before shared memory: one kind of round, over TCP
        s = {
            **s,
            "tcp_round_s": s["round_s"],
            "tcp_round_median_s": s["round_median_s"],
            "tcp_round_over_allreduce": s["round_over_allreduce"],
        }
    lines = [
        f"* **Speed** ({s['params']:,} floats, two rank processes on one host, interleaved): gloo "
        f"all-reduce {_runs(s['allreduce_s'])} s (median {s['allreduce_median_s']:.2f} s)."
    ]
    names = {
        "shm": "through shared memory (the default on one host)",
        "tcp": "over loopback TCP (`cluster.shared_memory=false`, or another host)",
    }
    for kind in ("shm", "tcp"):
        if f"{kind}_round_s" not in s:
            continue
        ratio = s[f"{kind}_round_over_allreduce"]
        upload = s.get(f"{kind}_upload_median_s")
        lines.append(
            f"  * cpu_* round {names[kind]}: {_runs(s[f'{kind}_round_s'])} s (median "
            f"{s[f'{kind}_round_median_s']:.2f} s) = **{ratio:.2f}x** the all-reduce (target "
            f"<= 2x: {'met' if ratio <= 2 else 'not met'})"
            + (f"; the snapshot's send returns after {upload:.2f} s (median)." if upload else ".")
        )
    return "\n".join(lines)


def _disk(d: dict[str, Any]) -> str:
    ratio = d["shard_over_plain"]
    return (
        f"* **Disk** ({d['bytes'] / 1e6:.0f} MB, {d['dir']}, interleaved, fsync'd): plain "
        f"write median {d['plain_mb_per_s']:.0f} MB/s, `write_shard` median "
        f"{d['shard_mb_per_s']:.0f} MB/s = **{ratio:.2f}x** "
        f"(target >= 0.5x: {'met' if ratio >= 0.5 else 'not met'}); runs plain "
        + " / ".join(f"{x:.2f}" for x in d["plain_s"])
        + " s, shard "
        + " / ".join(f"{x:.2f}" for x in d["shard_s"])
        + " s."
    )


def bulk_block(data: dict[str, Any], machine: Callable[[dict[str, Any]], str]) -> str:
    out = [machine(data), ""]
    if data.get("memory"):
        rows = data["memory"]
        p = statistics.median(r["param_mb"] for r in rows if r.get("param_mb"))
        out += [f"P = {p:.0f} MB of float32 parameters.", ""]
        plain = next((r for r in rows if r.get("mode") == "plain_loop"), None)
        if plain is not None and plain.get("status") == "ok":
            needs = (plain["peak_mb"] - plain["baseline_mb"]) / p
            out += [
                f"What the optimizer needs, measured: a plain PyTorch loop (no flodl; same model, "
                f"Adam, batches; same imports) peaks at {plain['peak_mb']:.0f} MB = baseline "
                f"{plain['baseline_mb']:.0f} MB + {needs:.1f} P (weights, gradients, two "
                "moments, and the temporaries of Adam's own step). "
                "A rank's extra copies are its peak above that, in P.",
                "",
            ]
        out += [_memory(rows), ""]
    if data.get("speed"):
        out.append(_speed(data["speed"]))
    if data.get("disk"):
        out.append(_disk(data["disk"]))
    return "\n".join(out).rstrip()


def big_block(data: dict[str, Any], machine: Callable[[dict[str, Any]], str]) -> str:
    header = [
        "run",
        "status",
        "epochs trained",
        "bundle epoch",
        "params",
        "model.pt == state",
        "bundle == state",
        "eval of model.pt == reported",
        "wall s",
    ]
    out = [machine(data), "", "| " + " | ".join(header) + " |"]
    out.append("|" + "|".join("---" for _ in header) + "|")
    for name in ("first", "resumed"):
        r = data.get(name)
        if not r:
            continue
        cells = [
            name,
            r["status"],
            str(r["epochs"]),
            str(r["bundle_epoch"]),
            f"{r['params']:,}",
            str(r["model_pt_equals_state"]),
            str(r["bundle_equals_state"]),
            f"{r['eval_matches']} ({r['model_pt_eval_value']:.4f})",
            _f(r["wall_s"]),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
