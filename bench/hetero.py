"""Heterogeneous-rig throughput: flodl's modes against solo runs and a plain DDP baseline.

    .venv/bin/python -m bench.hetero --repeats 3 --epochs 4 --rigs 1.0,0.4 1.0,1.0
    .venv/bin/python -m bench.hetero --quick          # smoke test: 1 repeat, 1 epoch

Same model (LeNet-5), data (mnist5k, 4,000 train / 1,000 test), batch size (64 per rank), seed
and CPU-rig deadline pacing (T = 1.3 x the slowest calibrated warm-up step, each step padded to
end at start + T / speed) for every variant:

* ``solo_fast`` / ``solo_slow``: flodl ``solo`` on one paced rank of speed 1.0 / the slow factor;
* ``ddp``: ``DistributedDataParallel`` over gloo, equal shards, ``mp.spawn`` (bench/ddp.py);
* every flodl mode on the 2-rank rig.

Each run is a fresh process; the variants are interleaved (repeat 1: every variant, repeat 2:
every variant, ..., the order rotated by one each repeat) and the tables show medians. Writes
bench/results/hetero.json; ``python -m bench.render`` turns it into the README tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.common import (
    MODES,
    child_main,
    exit_on_sigterm,
    log,
    machine,
    median,
    median_lists,
    ratio,
    run_isolated,
    wait_quiet,
    write_result,
)

WORKLOAD = "lenet"
BATCH = 64
PACE_MARGIN = 1.3
SEED = 42
#: flodl configurations measured beside the modes (bench.common.variant_elche says what each is)
BASELINES = ("nccl_cadence_bf16", "nccl_cadence_int8", "diloco", "fixed_cadence")
VARIANTS = ("solo_fast", "solo_slow", "ddp", *MODES, *BASELINES)


def _bytes_per_average(run: dict[str, Any]) -> float | None:
    """A cpu_* run's bytes on the wire per average (snapshots up and averages down); None for
    the collective modes (their bytes are not in the summary's ``averaging``)."""
    a = run.get("averaging") or {}
    if not a.get("averages"):
        return None
    return (a["up_bytes"] + a["down_bytes"]) / a["averages"]


def run_one(payload: dict[str, Any]) -> dict[str, Any]:
    """One measured run, in its own process (``--one``)."""
    kind, speeds, epochs = payload["kind"], payload["speeds"], payload["epochs"]
    workload, batch = payload.get("workload", WORKLOAD), payload.get("batch_size", BATCH)
    if kind == "ddp":
        from bench.ddp import run_ddp

        return run_ddp(
            speeds,
            epochs=epochs,
            workload=workload,
            batch_size=batch,
            seed=SEED,
            pace_margin=PACE_MARGIN,
            link=payload.get("link"),
        )
    from bench.common import run_flodl

    return run_flodl(
        workload,
        kind,
        epochs=epochs,
        batch_size=batch,
        speeds=speeds,
        pace_margin=PACE_MARGIN,
        seed=SEED,
        link=payload.get("link"),
        fixed_anchor=payload.get("fixed_anchor", 20),
    )


def plan(rigs: list[list[float]], modes: list[str] | None = None) -> list[tuple[str, list[float]]]:
    """The distinct runs of one repeat: solo per distinct speed, then DDP and modes per rig."""
    modes = list(modes) if modes else list(MODES)
    solo_speeds = sorted({s for rig in rigs for s in (max(rig), min(rig))}, reverse=True)
    runs: list[tuple[str, list[float]]] = [("solo", [s]) for s in solo_speeds]
    for rig in rigs:
        runs += [("ddp", rig)] + [(mode, rig) for mode in modes]
    return runs


def _paced_ideal(result: dict[str, Any], speeds: list[float], batch: int = BATCH) -> float | None:
    """Samples/s a perfectly paced run of this run's own nominal step would reach."""
    t_ms = result.get("nominal_step_ms")
    if not t_ms:
        return None
    return batch * sum(speeds) / (t_ms / 1000.0)


def _work(result: dict[str, Any]) -> float | None:
    """samples/s x T: throughput in samples per nominal step, independent of the run's own T."""
    t_ms = result.get("nominal_step_ms")
    return result["samples_per_s"] * t_ms / 1000.0 if t_ms else None


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def summarise(
    rigs: list[list[float]],
    repeats: list[dict[tuple[str, tuple[float, ...]], dict[str, Any]]],
    batch: int = BATCH,
) -> list[dict[str, Any]]:
    """One row per (rig, variant): medians over repeats; ratios taken per repeat, then median."""
    rows = []
    # the named variants, then any other one run (a mode's compressed form: cpu_cadence_int8)
    ran = {key[0] for rep in repeats for key in rep} - {"solo", *VARIANTS}
    for rig in rigs:
        fast, slow = (max(rig),), (min(rig),)
        for variant in (*VARIANTS, *sorted(ran)):
            if variant == "solo_fast":
                key = ("solo", fast)
            elif variant == "solo_slow":
                key = ("solo", slow)
            else:
                key = (variant, tuple(rig))
            runs = [rep.get(key) for rep in repeats]
            if not any(runs):
                continue  # a variant left out (--variants)
            ok = [r for r in runs if r and r.get("status") == "ok"]
            eff, eff_m, eff_t, vs_ddp, vs_ddp_m, vs_ddp_wall = [], [], [], [], [], []
            for rep, run in zip(repeats, runs, strict=True):
                if not run or run.get("status") != "ok":
                    continue
                sf, ss = rep.get(("solo", fast)), rep.get(("solo", slow))
                ddp = rep.get(("ddp", tuple(rig)))
                if sf and ss and sf.get("status") == ss.get("status") == "ok":
                    eff.append(run["samples_per_s"] / (sf["samples_per_s"] + ss["samples_per_s"]))
                    eff_m.append(
                        ratio(_work(run), _sum(_work(sf), _work(ss)))  # at equal T (see README)
                    )
                speeds_used = list(key[1])
                eff_t.append(ratio(run["samples_per_s"], _paced_ideal(run, speeds_used, batch)))
                if ddp and ddp.get("status") == "ok":
                    vs_ddp.append(run["samples_per_s"] / ddp["samples_per_s"])
                    vs_ddp_m.append(ratio(_work(run), _work(ddp)))
                    vs_ddp_wall.append(run["train_s"] / ddp["train_s"])
            rows.append(
                {
                    "speeds": rig,
                    "variant": variant,
                    "runs_ok": len(ok),
                    "runs": len(runs),
                    "samples": median([r["samples"] for r in ok]),
                    "samples_per_s": median([r["samples_per_s"] for r in ok]),
                    "efficiency": median(eff),
                    "efficiency_T_matched": median(eff_m),
                    "efficiency_own_T": median(eff_t),
                    "vs_ddp": median(vs_ddp),
                    "vs_ddp_T_matched": median(vs_ddp_m),
                    "train_s_vs_ddp": median(vs_ddp_wall),
                    "test_accuracy": median([r["test_metric"] for r in ok]),
                    "syncs": median([r["syncs"] for r in ok]),
                    "sync_overhead": median([r.get("sync_overhead") for r in ok]),
                    "mean_sync_ms": median([r.get("mean_sync_ms") for r in ok]),
                    "idle_fraction": median_lists([r.get("idle_fraction") for r in ok]),
                    "per_rank_batch_share": median_lists(
                        [r.get("per_rank_batch_share") for r in ok]
                    ),
                    "per_rank_ms_per_batch": median_lists(
                        [r.get("per_rank_ms_per_batch") for r in ok]
                    ),
                    "nominal_step_ms": median([r.get("nominal_step_ms") for r in ok]),
                    "train_s": median([r["train_s"] for r in ok]),
                    "startup_s": median([r.get("startup_s") for r in ok]),
                    "final_loss": median([r.get("final_loss") for r in ok]),
                    # cpu_* modes: bytes per average on the wire, up + down (summary.averaging)
                    "bytes_per_average": median([_bytes_per_average(r) for r in ok]),
                    # solo runs are per speed, shared by every rig that has that speed
                    "run": f"solo speed {key[1][0]}" if key[0] == "solo" else None,
                    "per_repeat": [
                        {
                            k: r.get(k)
                            for k in (
                                "status",
                                "samples_per_s",
                                "train_s",
                                "test_metric",
                                "syncs",
                                "sync_overhead",
                                "idle_fraction",
                                "nominal_step_ms",
                                "per_rank_ms_per_batch",
                                "load_before",
                                "others_busy_cores",
                                "waited_s",
                                "startup_s",
                                "mean_sync_ms",
                                "window_anchor",
                                "window_overhead",
                                "error",
                            )
                            if k in r
                        }
                        if r
                        else None
                        for r in runs
                    ],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if child_main(argv, run_one):
        return 0
    exit_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.hetero", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the 4,000-sample split")
    parser.add_argument(
        "--rigs",
        nargs="+",
        default=["1.0,0.4", "1.0,1.0"],
        help="rigs as comma-separated speeds, e.g. 1.0,0.4 1.0,1.0",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 epoch")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.6,
        help="before each run, wait while other processes keep this many cores busy",
    )
    parser.add_argument("--max-wait", type=float, default=10.0, help="at most this long (s)")
    parser.add_argument("--out", default="hetero", help="results file stem under bench/results")
    parser.add_argument("--workload", default=WORKLOAD, help="a bench.common workload")
    parser.add_argument("--batch-size", type=int, default=BATCH, help="per rank")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"only these modes (and ddp, solo); baselines: {', '.join(BASELINES)}",
    )
    parser.add_argument(
        "--link", default=None, help="cluster.link profile every 2-rank run (and DDP) crosses"
    )
    parser.add_argument(
        "--fixed-anchor", type=int, default=20, help="diloco / fixed_cadence: batches per window"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 1
        if args.out == "hetero":
            args.out = "hetero_quick"
    rigs = [[float(s) for s in rig.split(",")] for rig in args.rigs]
    if any(len(rig) != 2 for rig in rigs):
        parser.error("each rig needs two speeds (fast,slow)")
    runs = plan(rigs, args.variants)
    info = machine()
    started = time.perf_counter()
    repeats: list[dict[tuple[str, tuple[float, ...]], dict[str, Any]]] = []
    order_log = []
    for rep in range(args.repeats):
        shift = rep % len(runs)
        order = runs[shift:] + runs[:shift]
        results: dict[tuple[str, tuple[float, ...]], dict[str, Any]] = {}
        for kind, speeds in order:
            payload = {
                "kind": kind,
                "speeds": speeds,
                "epochs": args.epochs,
                "workload": args.workload,
                "batch_size": args.batch_size,
                "link": args.link,
                "fixed_anchor": args.fixed_anchor,
            }
            quiet = wait_quiet(args.quiet_cores, args.max_wait)
            t0 = time.perf_counter()
            res = run_isolated("bench.hetero", payload, args.timeout)
            res.update(quiet)
            results[(kind, tuple(speeds))] = res
            order_log.append([rep, kind, speeds])
            if res.get("status") == "ok":
                log(
                    f"[{rep + 1}/{args.repeats}] {kind:<12} {speeds}  "
                    f"{res['samples_per_s']:7.0f} samples/s  train {res['train_s']:5.1f} s  "
                    f"acc {res['test_metric']:.4f}  T {res.get('nominal_step_ms') or 0:.1f} ms  "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
            else:
                log(f"[{rep + 1}/{args.repeats}] {kind} {speeds} FAILED: {res.get('error')}")
                log(str(res.get("log", ""))[-2000:])
        repeats.append(results)
        # written after every repeat: a run cut short still leaves its finished repeats
        rows = summarise(rigs, repeats, args.batch_size)
        info["load_average_end"] = list(os.getloadavg())
        data = {
            "benchmark": "hetero",
            "machine": info,
            "settings": {
                "workload": args.workload,
                "dataset": "mnist5k (4000 train / 1000 test)",
                "batch_size": args.batch_size,
                "epochs": args.epochs,
                "samples_per_run": 4000 * args.epochs,
                "pace_margin": PACE_MARGIN,
                "seed": SEED,
                "repeats": len(repeats),
                "repeats_requested": args.repeats,
                "rigs": rigs,
                "link": args.link or "none",
                "fixed_anchor": args.fixed_anchor,
                "quick": args.quick,
                "quiet_cores": args.quiet_cores,
                "max_wait_s": args.max_wait,
                "bench_wall_s": time.perf_counter() - started,
            },
            "command": "python -m bench.hetero " + " ".join(argv),
            "order": order_log,
            "rows": rows,
        }
        path = write_result(args.out, data)
        log(f"wrote {path} ({len(repeats)} of {args.repeats} repeats)")
    failed = [r for r in rows if r["runs_ok"] < r["runs"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
