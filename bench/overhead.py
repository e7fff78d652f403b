"""Trainer overhead on one device: the flodl Trainer against a hand-written PyTorch loop.

    .venv/bin/python -m bench.overhead --repeats 9 --models lenet mlp
    .venv/bin/python -m bench.overhead --quick

Both sides train the same model (seeded init), optimizer, data (mnist5k train split, as one
``TensorDataset``), batch size, seed, per-epoch permutation
(``flodl.data.source.epoch_permutation``)
and number of steps, in a fresh process each, with the same torch thread count (``--threads``,
1 by default: with 2 threads on 2 shared cores OpenMP's barriers make every step hostage to
whatever else the machine runs, and the ratio becomes noise):

* ``flodl``: ``Trainer`` with ``mode=solo``, ``cluster=auto`` (in-process, no pacing),
  ``progress=off``, ``tensorboard=False``, no eval set.
* ``hand``: ``zero_grad / step(model, batch) / backward / optimizer.step / float(loss)`` over
  ``x[idx], y[idx]`` batches; before timing it runs the same untimed warm-up flodl's worker
  runs (1 + 8 steps on a throwaway deep copy), so both time a warm loop.

Training time: flodl's ``train_s`` (``samples / samples_per_s``: from the rank reporting Ready to
the controller receiving the last window's report) against the hand loop's first-to-last-step
time. Both include cutting batches out of the tensors (index + gather); neither includes process
start, imports, loading the data set, building the model or the warm-up. The end-to-end wall
(call to trained state) is reported separately, and so is the CPU time the whole process spent
while training (all threads: flodl's controller thread included), which other processes on the
machine disturb far less than wall time. Variants are interleaved, medians reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.common import (
    child_main,
    exit_on_sigterm,
    log,
    machine,
    median,
    run_isolated,
    wait_quiet,
    write_result,
)

BATCH = 64
SEED = 42
WARMUP_STEPS = 8  # flodl's ClusterConfig.warmup_steps default (its worker always calibrates)
# epochs per model: a few seconds of training each (an MLP step is ~6x cheaper than LeNet's)
DEFAULT_EPOCHS = {"lenet": 4, "mlp": 16, "logistic": 40, "conv_ae": 4, "resnet": 1}


def hand_loop(name: str, epochs: int) -> dict[str, Any]:
    import copy
    import itertools

    import torch

    from bench.common import (
        WORKLOADS,
        ModelFactory,
        OptimFactory,
        dataset_factory,
        evaluate_state,
        step_fn,
    )
    from flodl.data.source import epoch_permutation

    t_start = time.perf_counter()
    torch.manual_seed(SEED)
    model = ModelFactory(name)()
    model.train()
    make_optim = OptimFactory(WORKLOADS[name].optimizer)
    optimizer = make_optim(model.parameters())
    train_step = step_fn(name)
    inputs, target = dataset_factory(name, "train")().tensors
    n = len(target)

    # the same untimed warm-up as flodl's RankLoop.calibrate: a throwaway copy, 1 + 8 steps
    probe = copy.deepcopy(model)
    probe_opt = make_optim(probe.parameters())
    first = epoch_permutation(n, SEED, 0)[: BATCH * WARMUP_STEPS]
    batches = itertools.cycle([(inputs[i], target[i]) for i in first.split(BATCH)])
    for _ in range(1 + WARMUP_STEPS):
        probe_opt.zero_grad(set_to_none=True)
        train_step(probe, next(batches)).backward()
        probe_opt.step()

    steps, samples, last_loss_sum, last_count = 0, 0, 0.0, 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        for idx in epoch_permutation(n, SEED, epoch).split(BATCH):
            x, y = inputs[idx], target[idx]
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(model, (x, y))
            loss.backward()
            optimizer.step()
            value = float(loss.detach())
            steps += 1
            samples += len(idx)
            if epoch == epochs - 1:
                last_loss_sum += value
                last_count += 1
    train_s = time.perf_counter() - t0
    cpu_s = time.process_time() - cpu0
    total_s = time.perf_counter() - t_start
    return {
        "status": "ok",
        "steps": steps,
        "samples": samples,
        "train_s": train_s,
        "cpu_train_s": cpu_s,
        "total_s": total_s,
        "samples_per_s": samples / train_s,
        "final_loss": last_loss_sum / max(last_count, 1),
        "test_metric": evaluate_state(name, model.state_dict()),
        "threads": torch.get_num_threads(),
    }


def run_one(payload: dict[str, Any]) -> dict[str, Any]:
    import torch

    name, epochs = payload["model"], payload["epochs"]
    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])  # process-wide; flodl's worker thread inherits
    load_before = os.getloadavg()
    if payload["variant"] == "hand":
        result = hand_loop(name, epochs)
    else:
        from bench.common import run_flodl

        result = run_flodl(
            name, "solo", epochs=epochs, batch_size=BATCH, cluster_kind="auto", seed=SEED,
            with_eval=False,
        )  # fmt: skip
        result["threads"] = torch.get_num_threads()
        result["cpu_train_s"] = result["launcher_cpu_train_s"]  # in-process: all threads
        result["steps"] = -(-4000 // BATCH) * epochs
    result["load_before"] = load_before
    return result


def summarise(
    configs: list[tuple[str, int]], runs: dict[tuple[str, int, str], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One row per (model, threads): medians; the ratio per repeat, then the median."""
    rows = []
    for name, threads in configs:
        flodl_all, hand_all = runs[(name, threads, "flodl")], runs[(name, threads, "hand")]
        flodl_runs = [r for r in flodl_all if r.get("status") == "ok"]
        hand_runs = [r for r in hand_all if r.get("status") == "ok"]
        pairs = [
            (f, h)
            for f, h in zip(flodl_all, hand_all, strict=True)
            if f.get("status") == h.get("status") == "ok"
        ]
        rows.append(
            {
                "model": name,
                "steps": flodl_runs[0]["steps"] if flodl_runs else None,
                "threads": threads,
                "flodl_train_s": median([r["train_s"] for r in flodl_runs]),
                "hand_train_s": median([r["train_s"] for r in hand_runs]),
                # per repeat (flodl and hand back to back), then the median
                "train_ratio": median([f["train_s"] / h["train_s"] for f, h in pairs]),
                "train_ratio_of_medians": (
                    median([r["train_s"] for r in flodl_runs])
                    / median([r["train_s"] for r in hand_runs])
                    if flodl_runs and hand_runs
                    else None
                ),
                # best of the repeats: the least disturbed run of each side
                "train_ratio_of_mins": (
                    min(r["train_s"] for r in flodl_runs) / min(r["train_s"] for r in hand_runs)
                    if flodl_runs and hand_runs
                    else None
                ),
                # CPU seconds of the whole process while training (all threads): far less
                # sensitive than wall time to other processes on the machine
                "cpu_ratio": median(
                    [
                        f["cpu_train_s"] / h["cpu_train_s"]
                        for f, h in pairs
                        if f.get("cpu_train_s") and h.get("cpu_train_s")
                    ]
                ),
                "flodl_total_s": median([r["total_s"] for r in flodl_runs]),
                "hand_total_s": median([r["total_s"] for r in hand_runs]),
                "total_ratio": median([f["total_s"] / h["total_s"] for f, h in pairs]),
                "flodl_final_loss": median([r["final_loss"] for r in flodl_runs]),
                "hand_final_loss": median([r["final_loss"] for r in hand_runs]),
                "flodl_test_metric": median([r["test_metric"] for r in flodl_runs]),
                "hand_test_metric": median([r["test_metric"] for r in hand_runs]),
                "per_repeat": [
                    {
                        "flodl_train_s": f.get("train_s"),
                        "hand_train_s": h.get("train_s"),
                        "flodl_total_s": f.get("total_s"),
                        "hand_total_s": h.get("total_s"),
                        "flodl_cpu_train_s": f.get("cpu_train_s"),
                        "hand_cpu_train_s": h.get("cpu_train_s"),
                        "load_before": [f.get("load_before"), h.get("load_before")],
                        "others_busy_cores": [
                            f.get("others_busy_cores"),
                            h.get("others_busy_cores"),
                        ],
                    }
                    for f, h in zip(flodl_all, hand_all, strict=True)
                ],
            }
        )
    return rows


def write(
    args: argparse.Namespace,
    argv: list[str],
    info: dict[str, Any],
    started: float,
    done: int,
    configs: list[tuple[str, int]],
    runs: dict[tuple[str, int, str], list[dict[str, Any]]],
) -> None:
    """Write the results so far (after every repeat: a cut-short run keeps what it finished)."""
    info["load_average_end"] = list(os.getloadavg())
    data = {
        "benchmark": "overhead",
        "machine": info,
        "settings": {
            "dataset": "mnist5k (4000 train)",
            "batch_size": BATCH,
            "epochs": {m: args.epochs or DEFAULT_EPOCHS.get(m, 6) for m in args.models},
            "seed": SEED,
            "repeats": done,
            "repeats_requested": args.repeats,
            "models": args.models,
            "threads": args.threads,
            "quick": args.quick,
            "bench_wall_s": time.perf_counter() - started,
        },
        "command": "python -m bench.overhead " + " ".join(argv),
        "rows": summarise(configs, runs),
    }
    path = write_result(args.out, data)
    log(f"wrote {path} ({done} of {args.repeats} repeats)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if child_main(argv, run_one):
        return 0
    exit_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved pairs (median)")
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"epochs of the 4,000-sample split (default per model: {DEFAULT_EPOCHS})",
    )
    parser.add_argument("--models", nargs="+", default=["lenet", "mlp"])
    parser.add_argument(
        "--threads", nargs="+", type=int, default=[1], help="torch threads (both sides)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 epoch")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--quiet-cores", type=float, default=0.6)
    parser.add_argument("--max-wait", type=float, default=10.0)
    parser.add_argument("--out", default="overhead")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs = 1, 1
        if args.out == "overhead":
            args.out = "overhead_quick"
    epochs = {m: args.epochs or DEFAULT_EPOCHS.get(m, 6) for m in args.models}
    info = machine()
    started = time.perf_counter()
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    configs = [(name, threads) for name in args.models for threads in args.threads]
    for rep in range(args.repeats):
        for name, threads in configs:
            variants = ["flodl", "hand"] if rep % 2 == 0 else ["hand", "flodl"]
            for variant in variants:
                quiet = wait_quiet(args.quiet_cores, args.max_wait)
                payload = {"model": name, "variant": variant, "epochs": epochs[name]}
                payload["threads"] = threads
                res = run_isolated("bench.overhead", payload, args.timeout)
                res.update(quiet)
                runs.setdefault((name, threads, variant), []).append(res)
                if res.get("status") == "ok":
                    log(
                        f"[{rep + 1}/{args.repeats}] {name:<6} {threads}t {variant:<5} train "
                        f"{res['train_s']:6.3f} s  total {res['total_s']:6.2f} s  "
                        f"loss {res['final_loss']:.4f}  metric {res['test_metric']:.4f}"
                    )
                else:
                    log(f"[{rep + 1}/{args.repeats}] {name} {variant} FAILED: {res.get('error')}")
                    log(str(res.get("log", ""))[-2000:])
        write(args, argv, info, started, rep + 1, configs, runs)
    return 0 if all(r.get("status") == "ok" for v in runs.values() for r in v) else 1


if __name__ == "__main__":
    sys.exit(main())
