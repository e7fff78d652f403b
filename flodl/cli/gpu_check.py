"""``make gpu-check`` (``python -m flodl gpu-check``): is this CUDA machine ready for flodl?

Runs, in a few minutes, tiny real trainings of each CUDA path: the in-process single-GPU run,
``bf16-mixed``, ``16-mixed``, ``trainer.compile``, the ``cluster.batch_sizes=auto`` memory probe,
the memory plans' probe and a ``recompute+offload`` plan, and, with two or more visible GPUs, a
2-rank NCCL ``nccl_cadence`` run whose launcher (this process) must never initialise CUDA.
Each in-process check runs in its own child process, so one failure cannot hide another.
Prints a table; exits 1 when a check failed, 0 otherwise — also without CUDA, where there is
nothing to check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

BUDGET_S = 300.0
CHECKS: dict[str, dict[str, Any]] = {
    "single-GPU in-process (32)": {},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "16-mixed (GradScaler)": {"precision": "16-mixed"},
    "torch.compile": {"compile": True},
    "batch_sizes=auto probe": {"auto_batch": True},
    # cluster.memory_plan (docs/guides/memory-plans.md): the probe on CUDA's allocator, and a
    # plan's two elements with pinned host copies and asynchronous copies.
    "memory_plan=auto probe": {"plan": "auto", "expect": "no plan needed; probe peak"},
    "recompute+offload plan": {
        "plan": "recompute+offload",
        "expect": "activation checkpointing, optimizer state on host",
    },
}


def _data(split: str) -> Any:
    from flodl.recipes.datasets import synthetic

    return synthetic(split, n_train=2048, n_test=256, input_shape=[1, 8, 8], num_classes=4)


def _model(device: Any) -> Any:
    from flodl.recipes.models import MLP

    return MLP([1, 8, 8], 4, hidden=64).to(device)


def _optim(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(out: str, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One tiny run; returns what the checks assert on."""
    import torch

    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer, TrainerConfig
    from flodl.recipes.steps import classification_step

    mode = "solo" if world == 1 else "nccl_cadence"
    cluster = ClusterConfig(
        kind="auto",
        batch_sizes="auto" if options.get("auto_batch") else None,
        memory_plan=options.get("plan", "auto"),
    )
    builder = (
        Trainer.builder(_model, _optim, classification_step)
        .config(TrainerConfig(device="cuda"))
        .dataset(partial(_data, "train"))
        .batch_size(64)
        .num_epochs(2)
        .elche(ElCheConfig(mode=mode))
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False, level="WARNING"))
        .output_dir(out)
        .precision(options.get("precision", "32"))
        .compile(bool(options.get("compile", False)))
    )
    handle = builder.run()
    state = handle.join(timeout=240)
    losses = [m.avg_loss for m in handle.result.epochs]
    dtypes = sorted({str(t.dtype) for t in state.params.values()})
    if not losses or not all(x == x for x in losses) or losses[-1] >= losses[0]:
        raise AssertionError(f"loss did not fall: {losses}")
    if dtypes != [str(torch.float32)]:
        raise AssertionError(f"master weights are {dtypes}, not fp32")
    summary = handle.result.summary
    expect = options.get("expect")
    if expect and not any(expect in plan for plan in summary.memory_plans):
        raise AssertionError(f"memory plans {summary.memory_plans}: expected {expect!r}")
    return {"losses": losses, "devices": summary.world_size, "coverage": summary.coverage_exact}


def _one(name: str) -> int:
    """Child process: run one in-process check, print its JSON result line."""
    with tempfile.TemporaryDirectory() as out:
        try:
            result = _train(out, 1, CHECKS[name])
            print(
                json.dumps(
                    {
                        "ok": True,
                        "detail": f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}",
                    }
                )
            )
        except Exception as exc:
            print(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}))
    return 0


def _in_child(name: str, left_s: float) -> tuple[bool | None, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flodl.cli.gpu_check", "--one", name],
            capture_output=True,
            text=True,
            timeout=max(10.0, left_s),
        )
    except subprocess.TimeoutExpired:
        return False, "timed out"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return False, (proc.stderr.strip().splitlines() or ["no result"])[-1][:300]
    result = json.loads(lines[-1])
    return bool(result["ok"]), str(result["detail"])


def _nccl_two_ranks() -> tuple[bool | None, str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:2])  # exactly two ranks
    with tempfile.TemporaryDirectory() as out:
        result = _train(out, 2, {})
    if torch.cuda.is_initialized():
        return False, "the launcher initialised CUDA"
    if result["devices"] != 2 or not result["coverage"]:
        return False, f"world {result['devices']}, coverage exact {result['coverage']}"
    return True, f"loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}; launcher CUDA-free"


Row = tuple[str, bool | None, float, str]


def _row(rows: list[Row], name: str, check: Callable[[], tuple[bool | None, str]]) -> None:
    t0 = time.perf_counter()
    try:
        ok, detail = check()
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"[:300]
    rows.append((name, ok, time.perf_counter() - t0, detail))


def _print(rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"{'check'.ljust(width)}  status  seconds  detail")
    for name, ok, secs, detail in rows:
        status = "skip" if ok is None else "ok" if ok else "FAIL"
        print(f"{name.ljust(width)}  {status:<6}  {secs:7.1f}  {detail}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--one"]:
        return _one(args[1])
    from flodl.placement.gpus import (
        detect_gpus,  # nvidia-smi / KFD only: the launcher stays CUDA-free
    )

    gpus = detect_gpus()
    if not gpus:
        print("gpu-check: no CUDA device visible (nvidia-smi found none); nothing to check")
        return 0
    print(f"gpu-check: {len(gpus)} GPU(s): " + " | ".join(g.name for g in gpus), flush=True)
    start = time.perf_counter()
    rows: list[Row] = []
    if len(gpus) >= 2:  # first, while this process has never touched CUDA
        _row(rows, "2-rank NCCL nccl_cadence", _nccl_two_ranks)
    else:
        rows.append(("2-rank NCCL nccl_cadence", None, 0.0, "needs >= 2 visible GPUs"))
    for name in CHECKS:
        left = BUDGET_S - (time.perf_counter() - start)
        _row(rows, name, partial(_in_child, name, left))
    rows.append(("resident placement", None, 0.0, "not in this flodl (streaming only)"))
    _print(rows)
    return 1 if any(ok is False for _, ok, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
