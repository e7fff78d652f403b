"""Convergence per model and mode on the [1.0, 0.4] CPU rig, in the ddp-bench table format.

    .venv/bin/python -m bench.convergence                       # all models, 5 epochs (MNIST)
    .venv/bin/python -m bench.convergence --models lenet mlp --epochs 3
    .venv/bin/python -m bench.convergence --quick

Models that run offline: logistic, mlp, lenet (LeNet-5 + BN/ReLU) and conv_ae on mnist5k
(4,000 train / 1,000 test real MNIST digits), Adam 1e-3, batch 64, ``--epochs`` epochs (5, as in
ddp-bench); resnet (ResNet-20, SGD 0.05 m0.9 wd1e-4 from conf/optimizer/sgd.yaml) on synthetic
CIFAR-shaped data [3, 32, 32], ``--resnet-samples`` training samples, one epoch: a throughput
row, its accuracy means nothing. Variants: ``solo-fast`` (speed 1.0), ``solo-slow`` (speed 0.4)
and the five modes on the 2-rank rig. Per row: final training loss (mean of the last epoch),
eval on the test split (accuracy; MSE for conv_ae), total seconds (the job's wall: rank start-up,
calibration, training, final eval, teardown), training seconds, syncs. Hydra presets from
conf/elche/, ``lr_scale_ratio`` 0 (no LR scaling; the default is 1.0, the linear rule: the
bench compares the modes at one LR).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.common import (
    MODES,
    WORKLOADS,
    exit_on_sigterm,
    log,
    machine,
    run_flodl,
    wait_quiet,
    write_result,
)

RIG = [1.0, 0.4]
VARIANTS = ("solo-fast", "solo-slow", *MODES)


def run_variant(name: str, variant: str, epochs: int, resnet_samples: int) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if name == "resnet":
        overrides = {"n_train": resnet_samples, "n_test": max(64, resnet_samples // 4)}
        epochs = 1
    if variant == "solo-fast":
        mode, speeds = "solo", [max(RIG)]
    elif variant == "solo-slow":
        mode, speeds = "solo", [min(RIG)]
    else:
        mode, speeds = variant, RIG
    try:
        res = run_flodl(name, mode, epochs=epochs, speeds=speeds, dataset_overrides=overrides)
    except Exception as exc:  # a failed run is a failed row, not an aborted benchmark
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    res["epochs"] = epochs
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the MNIST models")
    parser.add_argument("--resnet-samples", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 epoch, 256 resnet")
    parser.add_argument("--quiet-cores", type=float, default=0.6)
    parser.add_argument("--max-wait", type=float, default=10.0)
    parser.add_argument("--out", default="convergence")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    if args.quick:
        args.epochs, args.resnet_samples = 1, 256
        if args.out == "convergence":
            args.out = "convergence_quick"
    info = machine()
    started = time.perf_counter()
    rows = []
    for name in args.models:
        for variant in args.variants:
            quiet = wait_quiet(args.quiet_cores, args.max_wait)
            res = run_variant(name, variant, args.epochs, args.resnet_samples)
            w = WORKLOADS[name]
            solo_speed = max(RIG) if variant == "solo-fast" else min(RIG)
            row = {
                "model": name,
                "variant": variant,
                "speeds": RIG if variant in MODES else [solo_speed],
                "eval_metric": w.eval_metric,
                "higher_is_better": w.higher_is_better,
                **quiet,
                **res,
            }
            rows.append(row)
            if res.get("status") == "ok":
                log(
                    f"{name:<8} {variant:<12} loss {res['final_loss']:.4f}  "
                    f"eval {res['test_metric']:.4f}  total {res['wall_s']:5.1f} s  "
                    f"train {res['train_s']:5.1f} s  syncs {res['syncs']}"
                )
            else:
                log(f"{name:<8} {variant:<12} FAILED: {res.get('error')}")
    info["load_average_end"] = list(os.getloadavg())
    data = {
        "benchmark": "convergence",
        "machine": info,
        "settings": {
            "rig": RIG,
            "pace_margin": 1.3,
            "batch_size": 64,
            "epochs_mnist": args.epochs,
            "resnet": f"synthetic [3,32,32], {args.resnet_samples} train samples, 1 epoch",
            "lr_scale_ratio": 0.0,
            "models": args.models,
            "variants": args.variants,
            "quick": args.quick,
            "bench_wall_s": time.perf_counter() - started,
        },
        "command": "python -m bench.convergence " + " ".join(argv),
        "rows": rows,
    }
    path = write_result(args.out, data)
    log(f"wrote {path}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
