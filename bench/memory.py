"""Memory-unequal rigs: a model the small ranks cannot hold, trained on every rank (issue 37).

    .venv/bin/python -m bench.memory --repeats 3 --epochs 2
    .venv/bin/python -m bench.memory --quick          # smoke test: 1 repeat, 1 epoch

A rig scaled like an RTX 4090 beside two RTX 3060s: memory [2:1:1] (``cluster.memory_mb``, the
rig's counted device memory), speeds [1.0, 0.45, 0.45]. The model (``mlp_wide``: 12.7 M
parameters, 48.5 MiB, Adam) peaks in a plain step at ~1.75x the small ranks' budget
(parameters, gradients, Adam's two moments, the temporaries of its step, activations at batch
64 and the resident data: the ``fits`` variant's probe measures it), so they cannot hold it.
Variants, every one a fresh process, interleaved per repeat (order rotated), medians reported:

* ``ddp``: torch DDP under the same budgets: out of memory on the small ranks (recorded);
* ``solo``: flodl ``solo`` on the big rank alone (speed 1.0, its budget): what a user without a
  plan can run, the baseline;
* ``plan3``: flodl ``nccl_cadence`` on all three ranks, ``cluster.memory_plan=auto``;
* ``plan2``: the same on two ranks, memory [2:1], speeds [1.0, 0.45];
* ``shard3``: flodl ``nccl_sync`` (lock-step, gradients all-reduced every step) on all three
  ranks, ``memory_plan=auto``: the optimizer state sharded in proportion to free memory;
* ``fits`` / ``noplan``: the three-rank rig with budgets everything fits, ``memory_plan=auto``
  (it probes and applies nothing) against ``memory_plan=none``: the plan's overhead where it is
  not needed (both pay the rig's memory counting).

Throughput is compared at equal calibrated step (T-matched: samples per nominal step), as
bench/hetero.py does. Writes bench/results/memory.json; ``python -m bench.render`` renders it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.common import (
    child_main,
    exit_on_sigterm,
    log,
    machine,
    median,
    ratio,
    run_isolated,
    wait_quiet,
    write_result,
)

WORKLOAD = "mlp_wide"
BATCH = 64
PACE_MARGIN = 1.3
SEED = 42
SMALL_MB = 180.0  # the small ranks' budget (the big rank's is twice that)
SPEEDS3 = [1.0, 0.45, 0.45]
SPEEDS2 = [1.0, 0.45]
VARIANTS = ("ddp", "solo", "plan3", "plan2", "shard3", "fits", "noplan")


def _setup(variant: str) -> tuple[list[float], list[float] | None]:
    """(speeds, memory_mb) of a variant (``noplan``: with ``memory_plan=none``)."""
    big = 2 * SMALL_MB
    return {
        "ddp": (SPEEDS3, [big, SMALL_MB, SMALL_MB]),
        "solo": ([1.0], [big]),
        "plan3": (SPEEDS3, [big, SMALL_MB, SMALL_MB]),
        "plan2": (SPEEDS2, [big, SMALL_MB]),
        "shard3": (SPEEDS3, [big, SMALL_MB, SMALL_MB]),
        "fits": (SPEEDS3, [4 * big] * 3),
        "noplan": (SPEEDS3, [4 * big] * 3),
    }[variant]


def run_one(payload: dict[str, Any]) -> dict[str, Any]:
    """One measured run, in its own process (``--one``)."""
    variant, epochs = payload["variant"], payload["epochs"]
    speeds, memory_mb = _setup(variant)
    if variant == "ddp":
        from bench.ddp import run_ddp

        try:
            return run_ddp(
                speeds,
                epochs=epochs,
                workload=WORKLOAD,
                batch_size=BATCH,
                seed=SEED,
                pace_margin=PACE_MARGIN,
                memory_mb=memory_mb,
            )
        except Exception as exc:  # a rank's OutOfMemoryError, re-raised by mp.spawn
            text = str(exc)
            oom = "OutOfMemoryError" in text or "out of memory" in text
            line = next((ln for ln in text.splitlines() if "out of memory" in ln), text[-300:])
            return {"status": "oom" if oom else "failed", "error": line.strip()}
    from bench.common import run_flodl

    knobs: dict[str, Any] = {"memory_mb": memory_mb} if memory_mb else {}
    if variant == "noplan":
        knobs["memory_plan"] = "none"
    return run_flodl(
        WORKLOAD,
        {"solo": "solo", "shard3": "nccl_sync"}.get(variant, "nccl_cadence"),
        epochs=epochs,
        batch_size=BATCH,
        speeds=speeds,
        pace_margin=PACE_MARGIN,
        seed=SEED,
        cluster_knobs=knobs,
    )


def _work(result: dict[str, Any]) -> float | None:
    """samples/s x T: samples per nominal step (comparable across runs of different T)."""
    t_ms = result.get("nominal_step_ms")
    return result["samples_per_s"] * t_ms / 1000.0 if t_ms else None


def summarise(repeats: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for variant in VARIANTS:
        runs = [rep.get(variant) for rep in repeats]
        if not any(runs):
            continue
        ok = [r for r in runs if r and r.get("status") == "ok"]
        vs_solo, vs_solo_t, vs_noplan_t = [], [], []
        for rep, run in zip(repeats, runs, strict=True):
            if not run or run.get("status") != "ok":
                continue
            solo, noplan = rep.get("solo"), rep.get("noplan")
            if solo and solo.get("status") == "ok":
                vs_solo.append(ratio(run["samples_per_s"], solo["samples_per_s"]))
                vs_solo_t.append(ratio(_work(run), _work(solo)))
            if noplan and noplan.get("status") == "ok":
                vs_noplan_t.append(ratio(_work(run), _work(noplan)))
        speeds, memory_mb = _setup(variant)
        first = next((r for r in runs if r), {})
        rows.append(
            {
                "variant": variant,
                "speeds": speeds,
                "memory_mb": memory_mb,
                "runs_ok": len(ok),
                "runs": len(runs),
                "status": [r.get("status") if r else None for r in runs],
                "error": first.get("error"),
                "samples_per_s": median([r["samples_per_s"] for r in ok]),
                "vs_solo": median(vs_solo),
                "vs_solo_T_matched": median(vs_solo_t),
                "vs_noplan_T_matched": median(vs_noplan_t),
                "test_accuracy": median([r.get("test_metric") for r in ok]),
                "final_loss": median([r.get("final_loss") for r in ok]),
                "nominal_step_ms": median([r.get("nominal_step_ms") for r in ok]),
                "startup_s": median([r.get("startup_s") for r in ok]),
                "memory_plans": ok[0].get("memory_plans") if ok else None,
                "peak_mem_mb": ok[0].get("peak_mem_mb") if ok else None,
                "overrun_fraction": median([r.get("overrun_fraction") for r in ok]),
                "per_repeat": [
                    {
                        k: r.get(k)
                        for k in (
                            "status",
                            "samples_per_s",
                            "nominal_step_ms",
                            "test_metric",
                            "final_loss",
                            "load_before",
                            "error",
                        )
                        if k in r
                    }
                    for r in runs
                    if r
                ],
            }
        )
    return rows


def _state_ratio() -> dict[str, float]:
    """The model's training state against the small budget, sized on meta (no memory), as
    the launch check sizes it (flodl/preflight/footprint.py)."""
    from types import SimpleNamespace

    from bench.common import WORKLOADS, ModelFactory, OptimFactory
    from flodl.preflight.footprint import footprint

    spec = SimpleNamespace(
        model_factory=ModelFactory(WORKLOAD),
        optim_factory=OptimFactory(WORKLOADS[WORKLOAD].optimizer),
    )
    size = footprint(spec)
    assert size is not None and size.optimizer is not None, "mlp_wide and Adam size on meta"
    params, state = size.params, size.optimizer
    mib = 2**20
    return {
        "params_mb": params / mib,
        "optimizer_state_mb": state / mib,
        "small_budget_mb": SMALL_MB,
    }


def _plain_peak(rows: list[dict[str, Any]]) -> float | None:
    """A plain step's peak in MiB, as the ``fits`` run's probe measured it (no plan needed)."""
    fits = next((r for r in rows if r["variant"] == "fits" and r["memory_plans"]), None)
    if fits is None:
        return None
    text = fits["memory_plans"][0]
    if "no plan needed; probe peak " not in text:
        return None
    value = text.rsplit("probe peak ", 1)[1].split()[0]
    return float(value) * (1024 if text.rstrip().endswith("GiB") else 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 1 epoch (results: *_quick)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=None, help="results stem (default: memory[_quick])")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 1
    exit_on_sigterm()
    repeats: list[dict[str, dict[str, Any]]] = []
    quiet = wait_quiet(0.5, 60.0)
    t0 = time.perf_counter()
    for k in range(args.repeats):
        order = args.variants[k % len(args.variants) :] + args.variants[: k % len(args.variants)]
        rep: dict[str, dict[str, Any]] = {}
        for variant in order:
            log(f"repeat {k + 1}/{args.repeats}: {variant}")
            rep[variant] = run_isolated(
                "bench.memory", {"variant": variant, "epochs": args.epochs}, args.timeout
            )
            r = rep[variant]
            log(
                f"  {r.get('status')} {r.get('samples_per_s') or 0:.1f} samples/s "
                f"{r.get('memory_plans') or r.get('error') or ''}"
            )
        repeats.append(rep)
    command = "python -m bench.memory " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = summarise(repeats)
    peak = _plain_peak(rows)
    write_result(
        args.out or ("memory_quick" if args.quick else "memory"),
        {
            "command": command,
            "machine": machine(),
            "quiet": quiet,
            "wall_s": time.perf_counter() - t0,
            "settings": {
                "workload": WORKLOAD,
                "batch_size": BATCH,
                "epochs": args.epochs,
                "repeats": args.repeats,
                "pace_margin": PACE_MARGIN,
                "mode": "nccl_cadence",
                "memory_plan": "auto",
                **_state_ratio(),
                "plain_peak_mb": peak,
                "plain_over_small": peak / SMALL_MB if peak else None,
            },
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    if not child_main(sys.argv[1:], run_one):
        sys.exit(main())
