"""Launch to first training step on the 2-rank CPU rig: flodl against torchrun + DDP.

    .venv/bin/python -m bench.startup --repeats 5
    .venv/bin/python -m bench.startup --quick

Each variant is one fresh command, timed from just before the benchmark starts it to the moment
the LAST rank enters its first call of the training step (every rank's first step, the
calibration's included, stamps the wall clock, its own CPU time and its launcher's CPU time into
a file named by ``BENCH_STARTUP_STAMP``):

* ``torchrun_ddp``: ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
  bench.ddp --torchrun ...``: bench/ddp.py's worker (DistributedDataParallel over gloo, the
  same calibration and pacing), its ranks placed by torchrun.
* ``flodl_api``: ``Trainer.builder(...).run().join()`` in a fresh interpreter, no eval set.
* ``flodl_run_py``: ``python run.py model=lenet ...``: the Hydra path with its defaults
  (eval metrics from torchmetrics, TensorBoard on).

All: LeNet on mnist5k, batch 64, speeds [1.0, 1.0], 1 epoch, 1 torch thread per rank. Variants
are interleaved (the order rotates each repeat); medians are reported. Under load wall times are
inflated, so the CPU seconds (user + sys) each rank and its launcher had spent by the first step
are reported too, and the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, exit_on_sigterm, log, machine, median, write_result

STAMP_ENV = "BENCH_STARTUP_STAMP"
VARIANTS = ("torchrun_ddp", "flodl_api", "flodl_run_py")
WORKLOAD, BATCH, SEED, EPOCHS, RANKS = "lenet", 64, 42, 1, 2
_stamped = False


# --- in the ranks -------------------------------------------------------------------------------
def stamp_first_step() -> None:
    """On this process's first call: append when, and the CPU seconds it and its parent (the
    launcher) had spent, to the file ``BENCH_STARTUP_STAMP`` names (nothing when unset)."""
    global _stamped
    path = os.environ.get(STAMP_ENV)
    if _stamped or not path:
        return
    _stamped = True
    import psutil

    me, parent = psutil.Process(), psutil.Process(os.getppid())
    own, theirs = me.cpu_times(), parent.cpu_times()
    record = {
        "pid": me.pid,
        "t": time.time(),
        "started": me.create_time(),
        "cpu_s": own.user + own.system,
        "launcher_cpu_s": theirs.user + theirs.system,
    }
    with open(path, "a", encoding="utf-8") as sink:
        sink.write(json.dumps(record) + "\n")


def stamped_step(model: Any, batch: Any) -> Any:
    """The workload's training step, stamped (importable: it reaches flodl's ranks by name)."""
    from bench.common import step_fn

    stamp_first_step()
    return step_fn(WORKLOAD)(model, batch)


def flodl_api() -> None:
    """The Python API path: one 2-rank run, built the way a user script builds it."""
    from bench.common import WORKLOADS, ModelFactory, OptimFactory, dataset_factory
    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer

    with tempfile.TemporaryDirectory(prefix="flodl-bench-startup-") as tmp:
        optim = OptimFactory(WORKLOADS[WORKLOAD].optimizer)
        (
            Trainer.builder(ModelFactory(WORKLOAD), optim, stamped_step)
            .dataset(dataset_factory(WORKLOAD, "train"))
            .batch_size(BATCH)
            .num_epochs(EPOCHS)
            .seed(SEED)
            .elche(ElCheConfig(mode="nccl_cadence"))
            .cluster(ClusterConfig(kind="cpu_rig", ranks=RANKS, speeds=[1.0] * RANKS))
            .logger(LoggerConfig(progress="off", tensorboard=False, level="WARNING"))
            .output_dir(tmp)
            .run()
            .join()
        )


# --- the benchmark ------------------------------------------------------------------------------
def command(variant: str, tmp: Path) -> list[str]:
    py = sys.executable
    if variant == "torchrun_ddp":
        from bench.common import WORKLOADS

        cfg = {
            "speeds": [1.0] * RANKS,
            "epochs": EPOCHS,
            "workload": WORKLOAD,
            "optimizer": WORKLOADS[WORKLOAD].optimizer,
            "batch_size": BATCH,
            "seed": SEED,
            "pace_margin": 1.3,
            "warmup_steps": 8,
        }
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
        return [*torchrun, "--nproc-per-node", str(RANKS), "-m", "bench.ddp", "--torchrun",
                json.dumps(cfg), str(tmp / "ddp.json")]  # fmt: skip
    if variant == "flodl_api":
        return [py, "-m", "bench.startup", "--child-api"]
    return [py, "run.py", f"model={WORKLOAD}", "cluster.speeds=[1.0,1.0]",
            f"trainer.num_epochs={EPOCHS}", "task.train_step=bench.startup.stamped_step",
            f"hydra.sweep.dir={tmp / 'multirun'}", "logger.progress=off"]  # fmt: skip


def run_variant(variant: str, timeout_s: float) -> dict[str, Any]:
    """Start one variant, wait for it; launch -> first step of every rank, CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="flodl-bench-startup-") as tmp_name:
        tmp = Path(tmp_name)
        stamps = tmp / "stamps.jsonl"
        env = {**os.environ, STAMP_ENV: str(stamps), "PYTHONPATH": str(REPO)}
        load_before = os.getloadavg()
        t0 = time.time()
        proc = subprocess.run(
            command(variant, tmp), cwd=REPO, env=env, capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )  # fmt: skip
        total_s = time.time() - t0
        lines = stamps.read_text().splitlines() if stamps.exists() else []
        records = [json.loads(line) for line in lines]
        if proc.returncode != 0 or len(records) != RANKS:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            return {"status": "failed", "error": f"exit {proc.returncode}", "log": tail}
    return {
        "status": "ok",
        "first_step_s": max(r["t"] for r in records) - t0,
        "rank_started_s": max(r["started"] for r in records) - t0,
        "rank_cpu_s": max(r["cpu_s"] for r in records),
        "launcher_cpu_s": max(r["launcher_cpu_s"] for r in records),
        "total_s": total_s,
        "load_before": load_before,
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    base = runs.get("torchrun_ddp", [])
    rows = []
    for variant, results in runs.items():
        ok = [r for r in results if r["status"] == "ok"]
        both = zip(results, base, strict=False)
        pairs = [(r, b) for r, b in both if r["status"] == b["status"] == "ok"]
        rows.append(
            {
                "variant": variant,
                "repeats_ok": len(ok),
                "first_step_s": median([r["first_step_s"] for r in ok]),
                "first_step_min_s": min((r["first_step_s"] for r in ok), default=None),
                "vs_torchrun": median([r["first_step_s"] / b["first_step_s"] for r, b in pairs]),
                "rank_started_s": median([r["rank_started_s"] for r in ok]),
                "rank_cpu_s": median([r["rank_cpu_s"] for r in ok]),
                "launcher_cpu_s": median([r["launcher_cpu_s"] for r in ok]),
                "total_s": median([r["total_s"] for r in ok]),
                "per_repeat": results,
            }
        )
    return rows


def startup_block(data: dict[str, Any], machine_line: str) -> str:
    """The docs/benchmarks table (bench/render.py): one row per variant, torchrun + DDP first."""
    s = data["settings"]
    lines = [
        machine_line,
        "",
        f"{s['ranks']} CPU ranks, speeds {s['speeds']}, {s['workload']}, batch {s['batch_size']}"
        f"; medians of {s['repeats']} interleaved repeats. *First step*: launch to the last "
        "rank's first call of the training step (calibration's included, on every side); "
        "*rank CPU* / *launcher CPU*: user + sys seconds spent by then (a rank, the process "
        "that started it). Wall times are inflated by the machine's load; CPU seconds far less.",
        "",
    ]
    header = ["variant", "first step s", "best s", "vs torchrun", "rank started s",
              "rank CPU s", "launcher CPU s", "whole run s", "load before (1 min)"]  # fmt: skip
    rows = []
    for r in data["rows"]:
        loads = [x["load_before"][0] for x in r["per_repeat"] if x.get("load_before")]
        rows.append(
            [
                r["variant"],
                _fmt(r["first_step_s"]),
                _fmt(r["first_step_min_s"]),
                _fmt(r["vs_torchrun"], ".2f"),
                _fmt(r["rank_started_s"]),
                _fmt(r["rank_cpu_s"]),
                _fmt(r["launcher_cpu_s"]),
                _fmt(r["total_s"], ".1f"),
                _fmt(median(loads), ".1f"),
            ]
        )
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines + table)


def _line(res: dict[str, Any]) -> str:
    if res["status"] != "ok":
        return f"FAILED: {res['error']}\n{res['log']}"
    return (
        f"first step {res['first_step_s']:5.2f} s  rank CPU {res['rank_cpu_s']:4.2f} s  "
        f"launcher CPU {res['launcher_cpu_s']:4.2f} s  load {res['load_before'][0]:.2f}"
    )


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "\u2013" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child-api"]:
        flodl_api()
        return 0
    exit_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default="startup")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
        args.out = "startup_quick" if args.out == "startup" else args.out
    info, started = machine(), time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for rep in range(args.repeats):
        shift = rep % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            res = run_variant(variant, args.timeout)
            runs[variant].append(res)
            log(f"[{rep + 1}/{args.repeats}] {variant:<13} " + _line(res))
        info["load_average_end"] = list(os.getloadavg())
        data = {
            "benchmark": "startup",
            "machine": info,
            "settings": {
                "workload": WORKLOAD,
                "batch_size": BATCH,
                "epochs": EPOCHS,
                "ranks": RANKS,
                "speeds": [1.0] * RANKS,
                "repeats": rep + 1,
                "repeats_requested": args.repeats,
                "bench_wall_s": time.perf_counter() - started,
            },
            "command": "python -m bench.startup " + " ".join(argv),
            "rows": summarise(runs),
        }
        log(f"wrote {write_result(args.out, data)}")
    return 0 if all(r["status"] == "ok" for v in runs.values() for r in v) else 1


if __name__ == "__main__":
    sys.exit(main())
