"""The ddp-bench block of docs/benchmarks/index.md and its loss-against-time plots
(bench/render.py).

Reads ``bench/results/ddp_bench.json`` (else ``ddp_bench_quick.json``): the table in the
original's format (loss / eval / s / syncs per workload and variant), the scaling each workload
ran at, the goals of the language-model issue, and one PNG per language model of validation loss
against wall time (since the end of calibration) for every variant.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from bench.common import RESULTS

LANGUAGE_MODELS = ("char_rnn", "gpt_nano")
NANOGPT_TOKENS = 2000 * 12 * 64  # baby GPT: 2,000 iterations of batch 12 x block 64
NANOGPT_VAL = 1.88
DASH = "\u2013"


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and row.get("status") == "ok"  # type: ignore[union-attr]


def _fmt(x: float | None, higher_is_better: bool) -> str:
    if x is None or not math.isfinite(x):
        return DASH
    if higher_is_better:
        return f"{x:.4f}"
    return f"{x:.6f}" if abs(x) < 0.01 else f"{x:.4f}"


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Seconds until the val curve first reaches ``target`` (linear between eval points)."""
    prev_t, prev_v = None, None
    for t, _epoch, v in curve:
        if v <= target:
            if prev_t is None or prev_v is None or prev_v == v:
                return t
            return prev_t + (t - prev_t) * (prev_v - target) / (prev_v - v)
        prev_t, prev_v = t, v
    return None


def _by(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["workload"], r["variant"]): r for r in data["rows"]}


def results_table(data: dict[str, Any]) -> str:
    s = data["settings"]
    by = _by(data)
    workloads = list(s["workloads"])
    header = ["mode", *workloads]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in s["variants"]:
        cells = [v]
        for w in workloads:
            r = by.get((w, v))
            if not _ok(r):
                cells.append("failed" if r else DASH)
                continue
            assert r is not None
            hib = s["workloads"][w]["higher_is_better"]
            syncs = DASH if v.startswith("solo") else str(r["syncs"])
            cells.append(
                f"{_fmt(r['final_loss'], False)}/{_fmt(r['eval'], hib)}/{r['total_s']:.1f}/{syncs}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_table(data: dict[str, Any]) -> str:
    lines = [
        "| workload | model | data | optimizer | schedule | epochs | batch | train samples "
        "| characters per epoch | overrides |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, d in data["settings"]["workloads"].items():
        opt = dict(d["optimizer"])
        target = opt.pop("target").rsplit(".", 1)[-1]
        opt_s = target + " " + ", ".join(f"{k} {v}" for k, v in opt.items())
        sched = d.get("scheduler")
        sched_s = (
            f"{sched['_target_'].rsplit('.', 1)[-1]} ({sched.get('interval')}, "
            f"warm-up {sched.get('warmup_fraction')}, floor {sched.get('floor')})"
            if isinstance(sched, dict)
            else "flat"
        )
        chars = d.get("tokens_per_epoch")
        lines.append(
            f"| {w} | {d['model'].rsplit('.', 1)[-1]} | {d['dataset'].rsplit('.', 1)[-1]} | "
            f"{opt_s} | {sched_s} | {d['epochs']} | {d['batch_size']} | {d['train_samples']} | "
            f"{chars if chars else DASH} | {' '.join(d.get('overrides') or []) or DASH} |"
        )
    return "\n".join(lines)


def _agreement(data: dict[str, Any], w: str, v: str) -> tuple[str, bool | None]:
    """Final eval against solo-fast's: LMs and conv_ae relative (<= 2 %), accuracy in points."""
    by = _by(data)
    solo, r = by.get((w, "solo-fast")), by.get((w, v))
    if not (_ok(solo) and _ok(r)):
        return DASH, None
    assert solo is not None and r is not None
    if data["settings"]["workloads"][w]["higher_is_better"]:
        gap = (solo["eval"] - r["eval"]) * 100.0
        return f"{gap:+.1f} pt", gap <= 0.5 + 1e-9  # accuracies are k / n: 0.5 pt exactly is in
    rel = (r["eval"] - solo["eval"]) / solo["eval"] * 100.0
    return f"{rel:+.1f} %", rel <= 2.0


def goals_table(data: dict[str, Any]) -> str:
    s = data["settings"]
    by = _by(data)
    modes = [v for v in s["variants"] if v not in ("solo-fast", "solo-slow")]
    lines = [
        "| workload | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for w in s["workloads"]:
        cells = []
        for v in modes:
            text, ok = _agreement(data, w, v)
            cells.append(text if ok is None else f"{text} {'ok' if ok else 'MISSED'}")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lms = [w for w in LANGUAGE_MODELS if w in s["workloads"]]
    if not lms:
        return "\n".join(lines)
    lines += ["", "| language model | solo-fast final val | time to it: nccl_cadence / torch DDP "
              "| ratio (goal <= 0.65) |", "|---|---|---|---|"]  # fmt: skip
    for w in lms:
        solo, cad, ddp = (by.get((w, v)) for v in ("solo-fast", "nccl_cadence", "ddp"))
        if not (_ok(solo) and _ok(cad) and _ok(ddp)):
            lines.append(f"| {w} | {DASH} | not measured | {DASH} |")
            continue
        assert solo is not None and cad is not None and ddp is not None
        target = solo["eval"]
        t_cad, t_ddp = time_to(cad["curve"], target), time_to(ddp["curve"], target)
        pair = f"{_num(t_cad)} s / {_num(t_ddp)} s"
        if t_cad is None or t_ddp is None:
            verdict = "not reached by " + " and ".join(
                n for n, t in (("nccl_cadence", t_cad), ("DDP", t_ddp)) if t is None
            )
        else:
            ratio = t_cad / t_ddp
            verdict = f"{ratio:.2f} {'ok' if ratio <= 0.65 else 'MISSED'}"
        lines.append(f"| {w} | {target:.4f} | {pair} | {verdict} |")
    return "\n".join([*lines, "", ddp_target_table(data, lms)])


def ddp_target_table(data: dict[str, Any], lms: list[str]) -> str:
    """Beside the goal (not the goal): time to torch DDP's own final val loss, a target both
    sides reach at equal epochs, for nccl_cadence and for DDP."""
    by = _by(data)
    lines = [
        "Beside the goal, a target both reach: time to torch DDP's final val loss.",
        "",
        "| language model | DDP final val | nccl_cadence s | torch DDP s | ratio |",
        "|---|---|---|---|---|",
    ]
    for w in lms:
        cad, ddp = by.get((w, "nccl_cadence")), by.get((w, "ddp"))
        if not (_ok(cad) and _ok(ddp)):
            lines.append(f"| {w} | {DASH} | {DASH} | {DASH} | not measured |")
            continue
        assert cad is not None and ddp is not None
        target = ddp["eval"]
        t_cad, t_ddp = time_to(cad["curve"], target), time_to(ddp["curve"], target)
        ratio = f"{t_cad / t_ddp:.2f}" if t_cad is not None and t_ddp else DASH
        lines.append(f"| {w} | {target:.4f} | {_num(t_cad)} | {_num(t_ddp)} | {ratio} |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return DASH if x is None else f"{x:.1f}"


def anchor_line(data: dict[str, Any]) -> str:
    """The nanoGPT anchor: every 2-rank variant's final val after nanoGPT's tokens, and the
    verdict (<= 1.88, and done sooner in wall time than solo-fast)."""
    d = data["settings"]["workloads"].get("gpt_nano")
    if not d:
        return "nanoGPT anchor: gpt_nano not run."
    tokens = d["epochs"] * (d.get("tokens_per_epoch") or 0)
    if tokens < NANOGPT_TOKENS:
        return (
            f"nanoGPT anchor (val <= {NANOGPT_VAL} after {NANOGPT_TOKENS:,} tokens, sooner than "
            f"solo-fast): **not measured** — this run trains gpt_nano on {tokens:,} tokens."
        )
    by = _by(data)
    solo = by.get(("gpt_nano", "solo-fast"))
    rows = [(v, by.get(("gpt_nano", v))) for v in data["settings"]["variants"]]
    ran = [(v, r) for v, r in rows if _ok(r)]
    vals = ", ".join(f"{v} {r['eval']:.4f} in {r['total_s']:.0f} s" for v, r in ran if r)
    verdicts = []
    for v, r in ran:
        if v.startswith("solo") or r is None:
            continue
        low = r["eval"] <= NANOGPT_VAL
        sooner = _ok(solo) and solo is not None and r["total_s"] < solo["total_s"]
        verdicts.append(
            f"{v}: {'ok' if low and sooner else 'MISSED'} "
            f"({'<=' if low else '>'} {NANOGPT_VAL}, {'sooner' if sooner else 'not sooner'} "
            "than solo-fast)"
        )
    verdict = ("; " + "; ".join(verdicts)) if verdicts else ""
    return f"nanoGPT anchor after {tokens:,} tokens (goal <= {NANOGPT_VAL}): {vals}{verdict}."


def anchor_block(data: dict[str, Any], machine_line: str) -> str:
    """The anchor run: what it trained, every variant's cell, the verdict."""
    s = data["settings"]
    return "\n".join(
        [
            machine_line,
            "",
            *merged_lines(data),
            f"Rig {s['rig']}, {lr_line(s['lr_scale_ratio'], len(s['rig']))}. Cell: final "
            "training loss / final val loss (nats/char) / total s / syncs.",
            "",
            results_table(data),
            "",
            scaling_table(data),
            "",
            anchor_line(data),
        ]
    )


def plot_curves(data: dict[str, Any], stem: str) -> list[Path]:
    """One PNG per language model: val loss against seconds since calibration, every variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    by = _by(data)
    for w in LANGUAGE_MODELS:
        rows = [(v, by.get((w, v))) for v in data["settings"]["variants"]]
        rows = [(v, r) for v, r in rows if _ok(r) and r and r.get("curve")]
        if not rows:
            continue
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for v, r in rows:
            assert r is not None
            t = [p[0] for p in r["curve"]]
            y = [p[2] for p in r["curve"]]
            style = "--" if v.startswith("solo") else ("-." if v == "ddp" else "-")
            ax.plot(t, y, style, marker="o", label="torch DDP" if v == "ddp" else v)
        quick = " (quick, under load: not a measurement)" if data["settings"]["quick"] else ""
        ax.set_title(f"{w}: validation loss against wall time{quick}", fontsize=10)
        ax.set_xlabel("seconds since calibration")
        ax.set_ylabel("val loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = RESULTS / f"{stem}_{w}.png"
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
        paths.append(path)
    return paths


def lr_line(ratio: float, world: int) -> str:
    """How the 2-rank cells' LR relates to solo's."""
    if not ratio:
        return "no LR scaling (lr_scale_ratio 0.0): every cell trains at solo's LR"
    factor = 1.0 + (world - 1) * ratio
    return (
        f"LR scaled on {world} ranks by {factor:g} (lr_scale_ratio {ratio:g}; torch DDP "
        "by the same rule), solo at the recipe's LR"
    )


def merged_lines(data: dict[str, Any]) -> list[str]:
    """Where a ``--merge``'d file's rows came from: a paragraph per earlier run (its rows'
    ``run``), naming its workloads (and variants, where it gave a workload only some)."""
    runs: dict[str, dict[str, Any]] = {}
    for r in data["rows"]:
        run = r.get("run")
        if run and run["command"] != data["command"]:
            runs.setdefault(run["command"], {"run": run, "cells": []})["cells"].append(r)
    lines = []
    for group in runs.values():
        run, cells = group["run"], group["cells"]
        parts = []
        for w in dict.fromkeys(c["workload"] for c in cells):
            variants = [c["variant"] for c in cells if c["workload"] == w]
            whole = set(variants) >= set(data["settings"]["variants"])
            parts.append(w if whole else f"{w} ({', '.join(variants)})")
        lines += [
            f"Rows of {', '.join(parts)} come from an earlier run ({run['date']}, load average "
            f"at start {[round(x, 2) for x in run.get('load_average') or []]}): "
            f"`.venv/bin/{run['command']}`",
            "",
        ]
    return lines


def rank_batch_line(rank_batch: int | None, world: int) -> str:
    """The clause for a run whose 2-rank cells train at their own per-rank batch."""
    if rank_batch is None:
        return ""
    return (
        f"; the {world}-rank cells and torch DDP at batch {rank_batch} per rank (global "
        f"{world * rank_batch}), solo at the workload's batch"
    )


def ddp_bench_block(data: dict[str, Any], stem: str, machine_line: str) -> str:
    s = data["settings"]
    load = data["machine"].get("load_average") or [0.0]
    cores = data["machine"].get("cores") or 1
    label = []
    if s["quick"]:
        label.append("**QUICK run** (`--quick`: a few steps per workload; proves the grid runs)")
    if max(load + (data["machine"].get("load_average_end") or [0.0])) > cores:
        label.append(f"**under load** (load average above the {cores} cores)")
    plots = plot_curves(data, stem)
    parts = [machine_line, "", *merged_lines(data)]
    parts += [
        (" — ".join(label) + ": these numbers are not side-by-side measurements.")
        if label
        else "One run per cell; side by side on one machine.",
        "",
        f"Rig {s['rig']}, {lr_line(s['lr_scale_ratio'], len(s['rig']))}"
        f"{rank_batch_line(s.get('rank_batch'), len(s['rig']))}. Cell: final "
        "training loss / final eval (accuracy; MSE for conv_ae; val loss in nats/char for the "
        "LMs) / total s (job wall incl. rank start-up) / syncs (optimizer steps for torch DDP).",
        "",
        results_table(data),
        "",
        "What each workload trained (the scaling):",
        "",
        scaling_table(data),
        "",
        "Goals: final eval against solo-fast at equal epochs (LMs, conv_ae: relative, goal "
        "<= 2 %; accuracy: points behind, goal <= 0.5), then time-to-loss (first time the val "
        "curve reaches solo-fast's final val loss, linear between per-epoch evals).",
        "",
        goals_table(data),
    ]
    if any(w in s["workloads"] for w in LANGUAGE_MODELS):
        parts += ["", anchor_line(data)]
    if plots:
        parts += ["", " ".join(f"![{p.stem}](results/{p.name})" for p in plots)]
    return "\n".join(parts)


def time_to_loss_block(data: dict[str, Any]) -> str:
    """Every variant's time to solo-fast's final val loss, against torch DDP's, per language
    model: the slow-link goal (``nccl_cadence`` in <= 0.5x DDP's time, no slower than the
    ``diloco`` and ``fixed_cadence`` baselines). Times run from the end of calibration, linear
    between per-epoch evaluations."""
    by = _by(data)
    s = data["settings"]
    overrides = [o for w in s["workloads"].values() for o in w.get("overrides", [])]
    links = [o.split("=", 1)[1] for o in overrides if o.startswith("cluster.link=")]
    link = links[0] if links else "none"
    lines = [
        f"Link `{link}`, rig {_rig(data)}, per-rank batch "
        f"{_rank_batch(s)}; target: solo-fast's final val loss. *@T*: the time scaled to torch "
        "DDP's calibrated step (each job paces at the step it calibrated under the load of its "
        "moment; the verdicts use these).",
        "",
        "| language model | variant | final val | samples/s | T ms | time to target | vs DDP "
        "| time @T | vs DDP @T |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for w in s["workloads"]:
        solo, ddp = by.get((w, "solo-fast")), by.get((w, "ddp"))
        if not _ok(solo):
            lines.append(f"| {w} | solo-fast | {DASH} |" + f" {DASH} |" * 3 + " not measured |"
                         + f" {DASH} |" * 3)  # fmt: skip
            continue
        assert solo is not None
        target = solo["eval"]
        t_ddp = time_to(ddp["curve"], target) if _ok(ddp) and ddp else None
        ref_ms = ddp.get("nominal_step_ms") if _ok(ddp) and ddp else None
        times: dict[str, float | None] = {}
        matched: dict[str, bool] = {}
        for v in s["variants"]:
            row = by.get((w, v))
            if not _ok(row):
                lines.append(f"| {w} | {v} | {DASH} |" + f" {DASH} |" * 2 + " failed |"
                             + f" {DASH} |" * 3)  # fmt: skip
                continue
            assert row is not None
            t = time_to(row["curve"], target)
            own_ms = row.get("nominal_step_ms")
            # solo trains at the workload's batch, not the 2-rank cells': its step is not DDP's
            same_batch = not v.startswith("solo")
            t_at = None
            if t is not None and ref_ms and own_ms and same_batch:
                t_at = t * ref_ms / own_ms
            times[v] = t_at if t_at is not None else t  # T-matched where both steps are known
            matched[v] = t_at is not None
            vs = f"{t / t_ddp:.2f}" if t is not None and t_ddp else DASH
            vs_at = f"{t_at / t_ddp:.2f}" if t_at is not None and t_ddp else DASH
            lines.append(
                f"| {w} | {v} | {row['eval']:.4f} | {row['samples_per_s']:.1f} | "
                f"{_num(own_ms)} | {_num(t) + ' s' if t is not None else 'not reached'} | {vs} | "
                f"{_num(t_at) + ' s' if t_at is not None else DASH} | {vs_at} |"
            )
        t_cad = times.get("nccl_cadence")
        if t_cad is None or t_ddp is None:
            verdicts.append(f"{w}: nccl_cadence or DDP did not reach the target: not measured")
            continue
        ratio = t_cad / t_ddp
        basis = " at equal step" if matched.get("nccl_cadence") else ""
        verdicts.append(
            f"{w}: nccl_cadence {ratio:.2f}x DDP's time{basis} (goal <= 0.5: "
            f"{'met' if ratio <= 0.5 else 'MISSED'})"
        )
        for base in ("diloco", "fixed_cadence"):
            if base in times:
                tb = times[base]
                ok = tb is None or t_cad <= tb
                verdicts.append(
                    f"{w}: nccl_cadence vs {base}: {_num(t_cad)} s / "
                    f"{_num(tb) + ' s' if tb is not None else 'not reached'} "
                    f"({'no slower: met' if ok else 'slower: MISSED'})"
                )
    return "\n".join([*lines, "", *(f"- {v}" for v in verdicts)])


def _rig(data: dict[str, Any]) -> list[float]:
    from bench.ddp_bench import RIG

    return list(data["settings"].get("rig") or RIG)


def _rank_batch(settings: dict[str, Any]) -> str:
    batches = {w.get("rank_batch") for w in settings["workloads"].values()}
    return ", ".join("the workload's" if b is None else str(b) for b in sorted(batches, key=str))
