"""Regenerate the result tables of the benchmarks page (docs/benchmarks/index.md) from
bench/results/*.json, and the summary block of the root README.

    .venv/bin/python -m bench.render            # rewrites the blocks between the markers
    .venv/bin/python -m bench.render --stdout   # prints them instead

Each block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (NAME: hetero,
overhead, convergence, targets, accuracy, ddp_bench, scale_sim, comm_heavy, startup) and carries the
machine the numbers came from and the command that reproduces them. Nothing in a block is
typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "docs" / "benchmarks" / "index.md"  # the docs site's page; plots: bench_assets


# --- formatting -------------------------------------------------------------------------------


def _num(x: Any, fmt: str = ".3f", dash: str = "\u2013") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return dash
    return format(x, fmt)


def _list(xs: Any, fmt: str = ".2f") -> str:
    if not xs:
        return "\u2013"
    return "[" + ", ".join(_num(x, fmt) for x in xs) + "]"


def _speeds(xs: list[float]) -> str:
    return "[" + ", ".join(str(float(x)) for x in xs) + "]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _machine(data: dict[str, Any]) -> str:
    m = data["machine"]
    load = m.get("load_average") or []
    end = m.get("load_average_end") or []
    wall = data.get("settings", {}).get("bench_wall_s")
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}; "
        f"{m['date']}; load average (1/5/15 min) at start {_list(load)}, at end {_list(end)}"
        + (f"; benchmark wall {wall / 60:.1f} min" if wall else "")
        + f".\nReproduce: `.venv/bin/{data['command'].strip()}`"
    )


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


# --- blocks -------------------------------------------------------------------------------------


def hetero_block(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        _machine(data),
        "",
        f"{s['workload']} on {s['dataset']}, batch {s['batch_size']} per rank, {s['epochs']} "
        f"epochs ({s['samples_per_run']} samples) per run, pace margin {s['pace_margin']}; "
        f"medians of {s['repeats']} interleaved repeats.",
        "",
    ]
    header = [
        "rig",
        "variant",
        "samples/s",
        "efficiency",
        "eff. T-matched",
        "vs DDP",
        "vs DDP T-matched",
        "train s",
        "T ms",
        "start-up s",
        "test acc",
        "syncs",
        "sync overhead",
        "idle [r0, r1]",
    ]
    rows = []
    for r in data["rows"]:
        rows.append(
            [
                _speeds(r["speeds"]),
                r["variant"]
                + (f" ({r['runs_ok']}/{r['runs']} ok)" if r["runs_ok"] < r["runs"] else ""),
                _num(r["samples_per_s"], ".0f"),
                _num(r["efficiency"]),
                _num(r.get("efficiency_T_matched")),
                _num(r["vs_ddp"], ".2f"),
                _num(r.get("vs_ddp_T_matched"), ".2f"),
                _num(r["train_s"], ".2f"),
                _num(r["nominal_step_ms"], ".1f"),
                _num(r["startup_s"], ".1f"),
                _num(r["test_accuracy"], ".4f"),
                _num(r["syncs"], ".0f"),
                _num(r["sync_overhead"]),
                _list(r["idle_fraction"]),
            ]
        )
    return "\n".join(lines) + "\n" + _table(header, rows)


def readme_summary_block(hetero: dict[str, Any] | None, overhead: dict[str, Any] | None) -> str:
    """The root README's benchmark summary: the hetero rig's table (fewer columns) and the
    sentences that quote it and the Trainer overhead, from the same result files."""
    if hetero is None:
        return "_No results yet: `.venv/bin/python -m bench.hetero`._"
    s, m = hetero["settings"], hetero["machine"]
    load = m.get("load_average") or []
    rows = {(tuple(r["speeds"]), r["variant"]): r for r in hetero["rows"]}
    lines = [
        f"Machine: {m['cores']}-core {m['cpu']} VM, torch {m['torch']}, {m['date']}, load "
        f"average {min(load):.1f}\u2013{max(load):.1f} at the start. Workload: {s['workload']} "
        f"on {s['dataset']}, batch {s['batch_size']} per rank, {s['epochs']} epochs, no LR "
        f"scaling, CPU-rig pacing with a nominal step of {s['pace_margin']}\u00d7 the measured "
        f"one; medians of {s['repeats']} interleaved repeats "
        f"(`.venv/bin/{hetero['command'].strip()}`).",
        "",
    ]
    header = ["rig", "variant", "samples/s", "efficiency", "efficiency, T-matched", "vs DDP",
              "vs DDP, T-matched", "test acc", "syncs", "idle per rank"]  # fmt: skip
    table = []
    for r in hetero["rows"]:
        if r["variant"].startswith("solo"):
            continue
        name = {"ddp": "torch DDP (gloo)", "nccl_cadence": "**nccl_cadence**"}.get(
            r["variant"], r["variant"]
        )
        idle = " / ".join(f"{x:.2f}" for x in r["idle_fraction"])
        table.append(
            [
                _speeds(r["speeds"]),
                name,
                _num(r["samples_per_s"], ".0f"),
                _num(r["efficiency"], ".2f"),
                _num(r.get("efficiency_T_matched"), ".2f"),
                _num(r["vs_ddp"], ".2f"),
                _num(r.get("vs_ddp_T_matched"), ".2f"),
                _num(r["test_accuracy"], ".3f"),
                _num(r["syncs"], ".0f"),
                idle,
            ]
        )
    lines.append(_table(header, table))
    hetero_rig = (1.0, 0.4)
    fast, slow = rows.get((hetero_rig, "solo_fast")), rows.get((hetero_rig, "solo_slow"))
    ddp, cad = rows.get((hetero_rig, "ddp")), rows.get((hetero_rig, "nccl_cadence"))
    text = []
    if fast and slow:
        text.append(
            f"Solo on the fast device: {fast['samples_per_s']:.0f} samples/s, on the slow one "
            f"{slow['samples_per_s']:.0f}; test accuracy {fast['test_accuracy']:.3f}."
        )
    if ddp and cad:
        text.append(
            f"Lock-step DDP on [1.0, 0.4] sits at its bound (the fast rank idles "
            f"{ddp['idle_fraction'][0]:.0%} of the time); `nccl_cadence` keeps both devices "
            f"busy (idle \u2264 {max(cad['idle_fraction']):.0%}): efficiency "
            f"{cad['efficiency']:.2f} on [1.0, 0.4] ({cad['efficiency_T_matched']:.2f} "
            f"T-matched), {cad['vs_ddp']:.2f}\u00d7 DDP's throughput "
            f"({cad['vs_ddp_T_matched']:.2f}\u00d7 T-matched)."
        )
    if overhead:
        ratios = {r["model"]: r for r in overhead["rows"] if r.get("threads", 1) == 1}
        parts = [f"{name} {r['train_ratio']:.3f}" for name, r in ratios.items()]
        bests = " / ".join(f"{r['train_ratio_of_mins']:.3f}" for r in ratios.values())
        text.append(
            "Trainer overhead on one device (`bench/overhead.py`, median of "
            f"{overhead['settings']['repeats']} interleaved repeats, one torch thread, "
            "training-time ratio Trainer \u00f7 hand-written loop doing the same steps bit for "
            f"bit, {overhead['machine']['date']}): {', '.join(parts)} (ratio of best runs "
            f"{bests})."
        )
    return "\n".join(lines) + "\n\n" + " ".join(text)


def comm_heavy_block(data: dict[str, Any]) -> str:
    """The hetero table of the communication-heavy rig, its all-reduce share and its plot."""
    s = data["settings"]
    share = s.get("allreduce_fraction")
    lines = [hetero_block(data)]
    if share is not None:  # measured on the nccl_cadence runs (none: not in this file)
        lines += [
            "",
            f"One parameter all-reduce = {_num(share)} of a step (the nccl_cadence runs' mean "
            "averaging time over step + averaging)."
            + (" **Quick run** (1 repeat, 1 epoch)." if s.get("quick") else ""),
        ]
    wire = [
        f"{r['variant']} {r['bytes_per_average'] / 1e6:.1f} MB"
        for r in data["rows"]
        if r.get("bytes_per_average")
    ]
    if wire:
        lines += ["", "Bytes on the wire per average, up and down (controller modes): "
                  + ", ".join(wire) + "."]  # fmt: skip
    if s.get("plot"):
        lines += ["", f"![{s['plot']}](results/{s['plot']})"]
    return "\n".join(lines)


def overhead_block(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        _machine(data),
        "",
        f"One device, in-process, torch threads {s.get('threads')}; {s['dataset']}, "
        f"batch {s['batch_size']}, "
        f"epochs {s['epochs']}; medians of {s['repeats']} interleaved repeats (ratios: per repeat, "
        "then the median; *ratio of bests*: fastest flodl run / fastest hand run).",
        "",
    ]
    header = [
        "model",
        "steps",
        "threads",
        "flodl train s",
        "hand train s",
        "train ratio",
        "ratio of bests",
        "CPU-time ratio",
        "flodl total s",
        "hand total s",
        "total ratio",
        "final loss flodl / hand",
        "test metric flodl / hand",
    ]
    rows = [
        [
            r["model"],
            _num(r["steps"], ".0f"),
            _num(r["threads"], ".0f"),
            _num(r["flodl_train_s"]),
            _num(r["hand_train_s"]),
            _num(r["train_ratio"], ".4f"),
            _num(r.get("train_ratio_of_mins"), ".4f"),
            _num(r.get("cpu_ratio"), ".4f"),
            _num(r["flodl_total_s"], ".2f"),
            _num(r["hand_total_s"], ".2f"),
            _num(r["total_ratio"], ".2f"),
            f"{_num(r['flodl_final_loss'], '.4f')} / {_num(r['hand_final_loss'], '.4f')}",
            f"{_num(r['flodl_test_metric'], '.4f')} / {_num(r['hand_test_metric'], '.4f')}",
        ]
        for r in data["rows"]
    ]
    return "\n".join(lines) + "\n" + _table(header, rows)


def _loss(x: Any) -> str:
    if x is None:
        return "\u2013"
    return f"{x:.6f}" if abs(x) < 0.01 else f"{x:.4f}"


def convergence_block(data: dict[str, Any]) -> str:
    s = data["settings"]
    models = s["models"]
    variants = s["variants"]
    by = {(r["model"], r["variant"]): r for r in data["rows"]}
    lines = [
        _machine(data),
        "",
        f"Rig {_speeds(s['rig'])} (pace margin {s['pace_margin']}), batch {s['batch_size']}, "
        f"MNIST models {s['epochs_mnist']} epochs, resnet: {s['resnet']}. Cell: final training "
        "loss / test eval (accuracy; MSE for conv_ae) / total s (job wall incl. rank start-up) / "
        "syncs.",
        "",
    ]
    rows = []
    for v in variants:
        cells = [v]
        for m in models:
            r = by.get((m, v))
            if not r or r.get("status") != "ok":
                cells.append("failed" if r else "\u2013")
                continue
            ev = _loss(r["test_metric"]) if not r["higher_is_better"] else f"{r['test_metric']:.4f}"
            syncs = str(r["syncs"]) if v not in ("solo-fast", "solo-slow") else "\u2013"
            cells.append(f"{_loss(r['final_loss'])}/{ev}/{r['wall_s']:.1f}/{syncs}")
        rows.append(cells)
    table = _table(["mode", *models], rows)
    # a throughput companion: training samples/s (start-up excluded)
    rows2 = []
    for v in variants:
        cells = [v]
        for m in models:
            r = by.get((m, v))
            ok = r and r.get("status") == "ok"
            cells.append(_num(r["samples_per_s"], ".0f") if ok else "\u2013")
        rows2.append(cells)
    table2 = _table(["training samples/s", *models], rows2)
    return "\n".join(lines) + "\n" + table + "\n\n" + table2


def accuracy_block(short: dict[str, Any] | None, long: dict[str, Any] | None) -> str:
    """Test accuracy against solo's, at the hetero run's length and at a longer one."""
    runs = [d for d in (short, long) if d]
    if not runs:
        return "_No results yet: run the command above._"
    lines = []
    if long:
        lines = [f"Longer run ({long['settings']['epochs']} epochs). {_machine(long)}", ""]
    header = ["rig", "variant"]
    for d in runs:
        header += [f"test acc, {d['settings']['epochs']} epochs", "points below solo"]
    keyed = [{(tuple(r["speeds"]), r["variant"]): r for r in d["rows"]} for d in runs]
    rows = []
    for key in keyed[0] if len(keyed) == 1 else [k for k in keyed[1] if k in keyed[0]]:
        if key[1] == "solo_slow":
            continue
        cells = [_speeds(list(key[0])), key[1]]
        for table in keyed:
            r, solo = table.get(key), table.get((key[0], "solo_fast"))
            acc = r["test_accuracy"] if r else None
            gap = (solo["test_accuracy"] - acc) * 100 if acc is not None and solo else None
            cells += [_num(acc, ".4f"), _num(gap, "+.2f")]
        rows.append(cells)
    return "\n".join([*lines, _table(header, rows)])


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def targets_block(
    hetero: dict[str, Any] | None,
    overhead: dict[str, Any] | None,
    long: dict[str, Any] | None = None,
) -> str:
    out = ["| target | measured | verdict |", "|---|---|---|"]

    def row(rig: list[float], variant: str) -> dict[str, Any] | None:
        for r in (hetero or {}).get("rows", []):
            if r["speeds"] == rig and r["variant"] == variant:
                return r
        return None

    def check(label: str, value: float | None, ok: bool | None, fmt: str = ".3f") -> None:
        out.append(
            f"| {label} | {_num(value, fmt)} | {_verdict(ok if value is not None else None)} |"
        )

    def inv(x: float | None) -> float | None:
        return 1.0 / x if x else None

    het = row([1.0, 0.4], "nccl_cadence")
    if het:
        for tag, e, v in (
            ("", het["efficiency"], het["vs_ddp"]),
            (" (T-matched)", het.get("efficiency_T_matched"), het.get("vs_ddp_T_matched")),
        ):
            check(
                f"[1.0, 0.4] nccl_cadence efficiency >= 0.95{tag}", e, e is not None and e >= 0.95
            )
            check(
                f"[1.0, 0.4] nccl_cadence samples/s >= 1.65 x DDP's{tag}",
                v,
                v is not None and v >= 1.65,
            )
    eq = row([1.0, 1.0], "nccl_cadence")
    if eq:
        for tag, v in (("", eq["vs_ddp"]), (" (T-matched)", eq.get("vs_ddp_T_matched"))):
            check(f"[1.0, 1.0] nccl_cadence samples/s >= DDP's{tag}", v, v is not None and v >= 1.0)
    sy = row([1.0, 1.0], "nccl_sync")
    if sy:
        for tag, w in (
            ("", sy["train_s_vs_ddp"]),
            (" (T-matched)", inv(sy.get("vs_ddp_T_matched"))),
        ):
            check(
                f"[1.0, 1.0] nccl_sync training wall <= 1.05 x DDP's{tag}",
                w,
                w is not None and w <= 1.05,
            )
    for data in (hetero, long):
        rows_by = {(tuple(r["speeds"]), r["variant"]): r for r in (data or {}).get("rows", [])}
        for rig in (data or {}).get("settings", {}).get("rigs", []):
            solo = rows_by.get((tuple(rig), "solo_fast"))
            if not solo or solo["test_accuracy"] is None:
                continue
            worst, worst_mode = None, None
            for mode in ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"):
                r = rows_by.get((tuple(rig), mode))
                if r and r["test_accuracy"] is not None:
                    gap = (solo["test_accuracy"] - r["test_accuracy"]) * 100
                    if worst is None or gap > worst:
                        worst, worst_mode = gap, mode
            assert data is not None
            check(
                f"{_speeds(rig)} every mode within 1 point of solo's test accuracy, "
                f"{data['settings']['epochs']} epochs (largest gap in points: {worst_mode})",
                worst,
                worst is not None and worst <= 1.0,
                ".2f",
            )
    for r in (overhead or {}).get("rows", []):
        t = r["train_ratio"]
        check(
            f"Trainer overhead <= 3 % ({r['model']}, training-time ratio)",
            t,
            t is not None and t <= 1.03,
            ".4f",
        )
        c = r.get("cpu_ratio")
        check(
            f"Trainer overhead <= 3 % ({r['model']}, CPU-time ratio)",
            c,
            c is not None and c <= 1.03,
            ".4f",
        )
    return "\n".join(out)


_LOADER_ROWS = [
    ("tensor", "TensorDataset (resident fast path)", "rig"),
    ("work0.1_w0", "~0.1 ms/sample, num_workers=0", "rig"),
    ("work0.1_w1", "~0.1 ms/sample, num_workers=1", "rig"),
    ("work1_w1", "~1 ms/sample, num_workers=1", "rig"),
    ("work1_w2", "~1 ms/sample, num_workers=2", "rig"),
    ("plain_dl2", "~1 ms/sample, plain loop + DataLoader(num_workers=2)", "one process"),
    ("solo_resident", "TensorDataset, solo (resident on CPU)", "one process"),
]


LOADER_HEADER = ["data", "where", "samples/s", "nominal step ms", "of the rig's limit",
                 "fast share", "data wait (per rank)", "paced steps late (per rank)"]  # fmt: skip


def loader_block(data: dict[str, Any]) -> str:
    s, goals = data["summary"], data["summary"]["goals"]
    rows = []
    for key, what, where in _LOADER_ROWS:
        v = s.get(key) or {}
        wait, late = v.get("data_wait_fraction"), v.get("pace_overrun_fraction")
        rows.append(
            [what, where, _num(v.get("samples_per_s"), ".0f"),
             _num(v.get("nominal_step_ms"), ".2f"), _num(v.get("rig_efficiency"), ".3f"),
             _num(v.get("fast_share"), ".3f"), _list(wait) if wait else "\u2013",
             _list(late) if late else "\u2013"]
        )  # fmt: skip
    rig = _speeds(data["speeds"])
    checks = [
        ["workers=1 vs TensorDataset (~0.1 ms)", _num(goals.get("w1_vs_tensor")), ">= 0.9"],
        ["... each at its own nominal step (share of the rig's limit)",
         _num(goals.get("w1_vs_tensor_same_step")), ">= 0.9"],
        ["workers=0 vs TensorDataset (~0.1 ms)", _num(goals.get("w0_vs_tensor")), "(beside it)"],
        ["fast rank's share, workers=1", _num(goals.get("w1_fast_share")), "0.67 +- 0.03"],
        ["workers=1 vs DataLoader(2) (~1 ms)", _num(goals.get("work1_vs_plain_dl2")), ">= 1.0"],
        ["workers=2 vs DataLoader(2) (~1 ms)", _num(goals.get("work1_w2_vs_plain_dl2")),
         ">= 1.0"],
    ]  # fmt: skip
    quick = " **Quick run (1 epoch, 1 repeat): a smoke test, not the goals' measurement.**"
    return "\n\n".join(
        [
            _machine(data),
            f"LeNet on mnist5k (4000 train), batch {data['batch_size']}, rig {rig} "
            f"(nccl_cadence, pace margin {data.get('pace_margin', 1.3):g}), "
            f"{data['epochs']} epoch(s), medians of {data['repeats']} "
            f"interleaved repeat(s); samples/s over the training time."
            + (quick if data.get("quick") else ""),
            _table(LOADER_HEADER, rows),
            _table(["goal", "measured", "target"], checks),
        ]
    )


# --- README surgery -----------------------------------------------------------------------------


def scale_sim_block(data: dict[str, Any]) -> str:
    """The simulated grid: efficiency vs the limit and vs lock-step DDP, controller cost."""
    st = data["settings"]
    comm, work = st["allreduce"], st["workload"]
    rows = [
        [
            str(r["ranks"]),
            r["scenario"],
            _num(r["efficiency"]),
            _num(r["lockstep_efficiency"]),
            _num(r["efficiency"] / r["lockstep_efficiency"], ".2f") + "\u00d7",
            _num(r["controller_ms_per_window"], ".2f"),
            _num(r.get("controller_per_reference"), ".4f"),
            _num(r["syncs_per_epoch"], ".1f"),
            "yes" if r["coverage_exact"] else "**no**",
        ]
        for r in data["rows"]
    ]
    header = ["ranks", "scenario", "efficiency", "lock-step", "vs lock-step",
              "controller ms/window", "ctl / ref loop", "syncs/epoch",
              "coverage exact"]  # fmt: skip
    wire = (
        f"the rig's `{comm['link']}` link model (flodl/rig/links.py) for "
        f"{comm['n_bytes'] / 1e6:.0f} MB"
        if comm.get("link")
        else f"{comm['alpha_ms']} ms + 2(N\u22121)/N \u00b7 {comm['n_bytes'] / 1e6:.0f} MB / "
        f"{comm['beta_gb_s']} GB/s"
    )
    model = (
        f"Model: ring all-reduce {wire}; a batch {work['base_ms']} ms"
        f" / speed, jitter \u03c3 {work['jitter']}; lock-step hides the all-reduce behind "
        f"{work['backward_fraction']:.2f} of the slowest step; {st['epochs']} epochs of "
        f"{st['batches_per_rank']} batches per rank; controller \u2192 rank latency "
        f'{st["latency_ms"]} ms. "ctl / ref loop": the controller\'s CPU ms per window over the '
        f"CPU ms of a fixed pure-Python loop ({st.get('reference_iterations', 200000):,} "
        "`total += i * i` iterations) timed next to it, for comparing loaded and quiet runs."
    )
    checks = [
        f"vs `{c['real']}` (real 2-rank nccl_cadence on [1.0, 0.4], load average "
        f"{_list(c['real_load_average'])}): real {_num(c['real_efficiency'])}"
        f"{' (at its own nominal step)' if c.get('real_efficiency_basis') == 'own_T' else ''}"
        ", simulated "
        f"{_num(c['sim_efficiency'])} ({c['relative_gap'] * 100:+.1f} %), syncs "
        f"{c['real_syncs']:.0f} / {c['sim_syncs']}"
        for c in data.get("real_check", [])
    ]
    check = ("\n\nChecked against real runs: " + "; ".join(checks) + ".") if checks else ""
    return _machine(data) + "\n\n" + model + check + "\n\n" + _table(header, rows)


def memory_block(data: dict[str, Any]) -> str:
    """Memory-unequal rig: torch DDP's out of memory, the big rank alone, flodl's plans."""
    st = data["settings"]
    names = {
        "ddp": "torch DDP, same budgets",
        "solo": "big rank alone (solo)",
        "plan3": "flodl nccl_cadence, memory_plan=auto",
        "plan2": "flodl nccl_cadence, memory_plan=auto",
        "shard3": "flodl nccl_sync, memory_plan=auto",
        "fits": "flodl, budgets that fit, memory_plan=auto",
        "noplan": "flodl, budgets that fit, memory_plan=none",
    }
    rows = []
    for r in data["rows"]:
        ok = r["runs_ok"] > 0
        status = f"{r['runs_ok']}/{r['runs']} ok" if ok else (r["status"][0] or "failed")
        plans = "; ".join(
            p.split(": ", 1)[1].split(";")[0] for p in r.get("memory_plans") or [] if p
        )
        rows.append(
            [
                names.get(r["variant"], r["variant"]),
                _speeds(r["speeds"]),
                _list(r["memory_mb"], ".0f") if r["memory_mb"] else "\u2013",
                status,
                _num(r["samples_per_s"], ".1f"),
                _num(r["vs_solo_T_matched"], ".2f") + ("\u00d7" if r["vs_solo_T_matched"] else ""),
                _num(
                    r["vs_noplan_T_matched"] if r["variant"] in ("fits", "noplan") else None, ".3f"
                ),
                _num(r["test_accuracy"], ".3f"),
                _num(r["final_loss"], ".3f"),
                _list(r.get("peak_mem_mb"), ".0f"),
                plans or (r.get("error") or "\u2013"),
            ]
        )
    header = ["variant", "speeds", "memory_mb", "status", "samples/s", "vs solo @T",
              "vs plan none @T", "test acc", "final loss", "peak MiB", "plans"]  # fmt: skip
    ratio = st.get("plain_over_small")
    setup = (
        f"Model `{st['workload']}` ({st['params_mb']:.1f} MiB of parameters, Adam: "
        f"{st['optimizer_state_mb']:.1f} MiB of state), batch {st['batch_size']} per rank, "
        f"{st['epochs']} epoch(s), {st['repeats']} interleaved repeat(s), medians; pace margin "
        f"{st['pace_margin']}. "
        + (
            f"A plain step peaks at {_num(st.get('plain_peak_mb'), '.0f')} MiB, "
            f"{_num(ratio, '.2f')}\u00d7 the small ranks' budget of "
            f"{st['small_budget_mb']:.0f} MiB. "
            if st.get("plain_peak_mb")  # measured by the `fits` variant's probe
            else f"The small ranks' budget: {st['small_budget_mb']:.0f} MiB. "
        )
        + '"@T": samples per calibrated nominal step, the rig\'s fair comparison across runs '
        "whose calibrated steps differ."
    )
    by = {r["variant"]: r for r in data["rows"]}
    verdicts = []
    solo = by.get("solo") or {}
    for name, ranks, goal in (("plan3", 3, 1.4), ("plan2", 2, 1.2)):
        r = by.get(name) or {}
        if r.get("vs_solo_T_matched") is not None:
            v = r["vs_solo_T_matched"]
            verdicts.append(
                f"{ranks} ranks: {v:.2f}\u00d7 the big rank alone at equal step (goal \u2265 {goal}"
                f"\u00d7: {'met' if v >= goal else 'missed'}), test accuracy "
                f"{_num(r.get('test_accuracy'))} against solo's {_num(solo.get('test_accuracy'))}"
            )
    shard = by.get("shard3") or {}
    if shard.get("vs_solo_T_matched") is not None:  # lock-step: bounded by 3 x 0.45 = 1.35
        verdicts.append(
            f"nccl_sync with the state sharded, 3 ranks: {shard['vs_solo_T_matched']:.2f}\u00d7 "
            f"the big rank alone at equal step (lock-step's bound on these speeds: 1.35\u00d7), "
            f"test accuracy {_num(shard.get('test_accuracy'))}"
        )
    fits = (by.get("fits") or {}).get("vs_noplan_T_matched")
    if fits is not None:
        verdicts.append(
            f"the plan where nothing needs one: {fits:.3f} of `memory_plan=none`'s throughput "
            f"(goal: at most 2 % slower: {'met' if fits >= 0.98 else 'missed'})"
        )
    plan3, raw = by.get("plan3") or {}, None
    if plan3.get("nominal_step_ms") and solo.get("nominal_step_ms"):
        raw = plan3["nominal_step_ms"] / solo["nominal_step_ms"]
    note = (
        f" Raw samples/s are not comparable across these rows: three ranks calibrating at once on "
        f"this machine's cores measure a step {raw:.2f}\u00d7 longer than one rank alone."
        if raw
        else ""
    )
    summary = ("; ".join(verdicts) + "." + note) if verdicts else ""
    return _machine(data) + "\n\n" + setup + "\n\n" + _table(header, rows) + "\n\n" + summary


def replace_block(text: str, name: str, body: str) -> str:
    # An empty block (begin right above end, as a new block starts) matches too.
    pattern = re.compile(rf"(<!-- {name}:begin -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- {name}:begin --> / end markers for the {name} block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def _ddp_bench() -> str:
    from bench.ddp_bench_report import anchor_block, ddp_bench_block

    full, quick = _load("ddp_bench"), _load("ddp_bench_quick")
    blocks = []
    if full:
        blocks.append(ddp_bench_block(full, "ddp_bench", _machine(full)))
    if quick:  # the workloads no full run measured yet, labelled quick
        measured = {row["workload"] for row in full["rows"]} if full else set()
        rest = [row for row in quick["rows"] if row["workload"] not in measured]
        if rest:
            kept = {**quick, "rows": rest}
            kept["settings"] = {
                **quick["settings"],
                "workloads": {
                    w: d for w, d in quick["settings"]["workloads"].items() if w not in measured
                },
            }
            title = "#### Workloads without a full run yet (quick)\n\n" if full else ""
            blocks.append(title + ddp_bench_block(kept, "ddp_bench_quick", _machine(quick)))
    variants = []  # the other full runs, in this order after the full grid (before the quick)
    scaled = _load("ddp_bench_lr1")  # the grid again, at the linear LR rule
    if scaled:
        lms = {"char_rnn", "gpt_nano"}
        which = (
            "The language models"
            if {row["workload"] for row in scaled["rows"]} <= lms
            else "The grid"
        )
        variants.append(
            f"#### {which} with the linear LR rule (lr_scale_ratio 1.0)\n\n"
            + ddp_bench_block(scaled, "ddp_bench_lr1", _machine(scaled))
        )
    same = _load("ddp_bench_global")  # the 2-rank cells at half the batch: solo's global batch
    if same:
        variants.append(
            "#### At solo's global batch (`--rank-batch`: as many optimizer steps as solo)\n\n"
            + ddp_bench_block(same, "ddp_bench_global", _machine(same))
        )
    anchor = _load("ddp_bench_anchor")  # gpt_nano for the nanoGPT anchor's tokens
    if anchor:
        variants.append("#### The nanoGPT anchor\n\n" + anchor_block(anchor, _machine(anchor)))
    at = 1 if full else 0
    blocks[at:at] = variants
    return "\n\n".join(blocks) or "_No results yet: run the command above._"


def _bulk(stem: str, block: str) -> str:
    from bench import bulk_report

    data = _load(stem)
    if not data:
        return "_No results yet: run the command above._"
    return getattr(bulk_report, block)(data, _machine)


def _startup(missing: str) -> str:
    from bench.startup import startup_block

    data = _load("startup") or _load("startup_quick")  # the full run when there is one
    return startup_block(data, _machine(data)) if data else missing


def _block(stem: str, block: Any, missing: str) -> str:
    data = _load(stem)
    return block(data) if data else missing


def render() -> dict[str, str]:
    hetero, overhead, convergence = _load("hetero"), _load("overhead"), _load("convergence")
    sim = _load("scale_sim")
    comm = _load("comm_heavy") or _load("comm_heavy_quick")  # the full run when there is one
    missing = "_No results yet: run the command above._"
    return {
        "bulk": _bulk("bulk", "bulk_block"),
        "big": _bulk("big", "big_block"),
        "ddp_bench": _ddp_bench(),
        "hetero": hetero_block(hetero) if hetero else missing,
        "nccl_sync_equal": _block("hetero_sync_equal", hetero_block, missing),
        "overhead": overhead_block(overhead) if overhead else missing,
        "convergence": convergence_block(convergence) if convergence else missing,
        "targets": targets_block(hetero, overhead, _load("hetero_long")),
        "accuracy": accuracy_block(hetero, _load("hetero_long")),
        "loader": _loader(missing),
        "loader_headroom": _block("loader_margin2.5", loader_block, missing),
        "scale_sim": scale_sim_block(sim) if sim else missing,
        "scale_sim_10gbe": _block("scale_sim_10gbe", scale_sim_block, missing),
        "comm_heavy": comm_heavy_block(comm) if comm else missing,
        "comm_heavy_equal": _block("comm_heavy_equal", comm_heavy_block, missing),
        "comm_heavy_1gbe": _block("comm_heavy_1gbe", comm_heavy_block, missing),
        "comm_heavy_pcie": _block("comm_heavy_pcie", comm_heavy_block, missing),
        "comm_heavy_1gbe_cpu": _block("comm_heavy_1gbe_cpu", comm_heavy_block, missing),
        "gpt_nano_1gbe": _gpt_nano_1gbe(missing),
        "startup": _startup(missing),
        "memory": _block("memory", memory_block, missing),
        "memory_shard": _block("memory_shard", memory_block, missing),
        "hf_lora": _hf_lora(missing),
    }


def _gpt_nano_1gbe(missing: str) -> str:
    """Each run of the gpt_nano time-to-loss grid (``ddp_bench_gpt_1gbe``, then its reruns
    ``_2``, ``_3``, ...), one block each: a run's cells are side by side, runs are not."""
    from bench.ddp_bench_report import time_to_loss_block

    blocks, k = [], 1
    while data := _load("ddp_bench_gpt_1gbe" + (f"_{k}" if k > 1 else "")):
        blocks.append(f"**Run {k}.** {_machine(data)}\n\n{time_to_loss_block(data)}")
        k += 1
    return "\n\n".join(blocks) if blocks else missing


def _hf_lora(missing: str) -> str:
    from bench.hf_lora import hf_lora_block

    data = _load("hf_lora") or _load("hf_lora_quick")  # the full run when there is one
    return hf_lora_block(data, _machine(data)) if data else missing


def _loader(missing: str) -> str:
    data = _load("loader") or _load("loader_quick")  # the full run when there is one
    return loader_block(data) if data else missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.render", description=__doc__)
    parser.add_argument("--stdout", action="store_true", help="print the blocks, touch nothing")
    args = parser.parse_args(argv)
    blocks = render()
    if args.stdout:
        for name, body in blocks.items():
            print(f"<!-- {name} -->\n{body}\n")
        return 0
    text = README.read_text(encoding="utf-8")
    for name, body in blocks.items():
        text = replace_block(text, name, body)
    README.write_text(text, encoding="utf-8")
    print(f"updated {README}", file=sys.stderr)
    root = ROOT / "README.md"  # the project's README: its summary block
    summary = readme_summary_block(_load("hetero"), _load("overhead"))
    root.write_text(
        replace_block(root.read_text(encoding="utf-8"), "bench_summary", summary),
        encoding="utf-8",
    )
    print(f"updated {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
