"""The data path: DataLoader workers fed by the plan against the in-memory fast path.

    .venv/bin/python -m bench.loader              # the issue's goals (run it on an idle machine)
    .venv/bin/python -m bench.loader --quick      # smoke test: 1 repeat, 1 epoch
    .venv/bin/python -m bench.loader --pace-margin 2.5 --out loader_margin2.5

Every variant trains LeNet on the 4,000 mnist5k training images in a fresh process:

* ``tensor``: the 2-rank CPU rig ``[1.0, 0.5]`` on the ``TensorDataset`` (resident: the fast
  path, one gather per batch);
* ``work0.1_w0`` / ``work0.1_w1``: the same rig on a map-style dataset whose ``__getitem__``
  decompresses its image and then does real CPU work up to ~0.1 ms per sample, with
  ``loader.num_workers`` 0 (in the training thread) and 1 (one DataLoader worker per rank);
* ``work1_w1`` / ``work1_w2``: ~1 ms per sample, the rig with one / two workers per rank,
  against ``plain_dl2``:
  a plain single-process PyTorch loop over ``DataLoader(num_workers=2, shuffle=True)``;
* ``solo_resident``: one in-process rank on the ``TensorDataset`` (no pacing): what resident
  placement costs on CPU, next to ``bench.overhead``'s hand loop.

``--pace-margin M`` runs the rig at ``cluster.pace_margin=M`` (1.3 by default): at 1.3 the
paced ranks' simulated device compute is CPU work that keeps ~1.15 of the 2 cores busy beside the
loader workers; a larger margin leaves the CPU the headroom a GPU rig leaves it.

Goals (issue 12): ``work0.1_w1`` >= 0.9x the samples/s of ``tensor`` with the fast rank's share
0.67 +- 0.03; ``work1_w1`` >= 1.0x ``plain_dl2``. Throughput is flodl's ``samples_per_s``
(training time: from Ready to the last report) and the plain loop's first-to-last step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from typing import Any

from bench.common import (
    _probe_calibration,
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
SPEEDS = [1.0, 0.5]
PACE_MARGIN = 1.3
VARIANTS: dict[str, dict[str, Any]] = {
    "tensor": {"work_ms": None, "workers": 0},
    "work0.1_w0": {"work_ms": 0.1, "workers": 0},
    "work0.1_w1": {"work_ms": 0.1, "workers": 1},
    "work1_w1": {"work_ms": 1.0, "workers": 1},
    "work1_w2": {"work_ms": 1.0, "workers": 2},
    "plain_dl2": {"work_ms": 1.0, "workers": 2, "plain": True},
    "solo_resident": {"work_ms": None, "workers": 0, "solo": True},
}


class WorkDataset:
    """mnist5k as compressed bytes: ``__getitem__`` decompresses, converts, and spins on real
    CPU work until ``work_ms`` has passed (a decode/augment stand-in with a known cost)."""

    def __init__(self, split: str = "train", work_ms: float = 0.1) -> None:
        from flodl.recipes.datasets import mnist5k

        x, y = mnist5k(split).tensors
        self.shape = tuple(x.shape[1:])
        self.blobs = [zlib.compress(row.numpy().tobytes(), 6) for row in x]
        self.labels = y
        self.work_s = work_ms / 1000.0

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import torch

        t0 = time.perf_counter()
        image = torch.frombuffer(bytearray(zlib.decompress(self.blobs[i])), dtype=torch.float32)
        acc = 0
        while time.perf_counter() - t0 < self.work_s:
            acc += sum(range(50))  # the rest of a ~work_ms decode, as CPU work
        return image.view(self.shape).clone(), self.labels[i]


def _dataset(work_ms: float | None) -> Any:
    from functools import partial

    from bench.common import dataset_factory

    if work_ms is None:
        return dataset_factory("lenet", "train")
    return partial(WorkDataset, "train", work_ms)


def flodl_run(variant: str, epochs: int, margin: float = PACE_MARGIN) -> dict[str, Any]:
    from bench.common import WORKLOADS, ModelFactory, OptimFactory, step_fn
    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.config import ElCheConfig

    spec = VARIANTS[variant]
    solo = spec.get("solo", False)
    cluster = (
        ClusterConfig(kind="auto")
        if solo
        else ClusterConfig(kind="cpu_rig", ranks=2, speeds=SPEEDS, pace_margin=margin)
    )
    calibrated: list[dict[str, Any]] = []
    if not solo:
        _probe_calibration(calibrated)
    t0 = time.perf_counter()
    handle = (
        Trainer.builder(ModelFactory("lenet"), OptimFactory(WORKLOADS["lenet"].optimizer),
                        step_fn("lenet"))
        .dataset(_dataset(spec["work_ms"]))
        .batch_size(BATCH)
        .num_epochs(epochs)
        .seed(SEED)
        .elche(ElCheConfig(mode="solo" if solo else "nccl_cadence"))
        .cluster(cluster)
        .loader(num_workers=spec["workers"])
        .logger(LoggerConfig(progress="off", tensorboard=False, level="WARNING"))
        .output_dir(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"flodl-bench-loader-{variant}"))
        .run()
    )  # fmt: skip
    handle.join()
    s = handle.result.summary
    tele = s.telemetry or []
    steps = [c["step_ms"] for c in calibrated if c["step_ms"]]
    nominal_ms = max(steps) * margin if steps else None
    # The rig's limit at this run's nominal step T: every rank flat out, batches of BATCH at
    # speed / T each. Its share of it compares runs whose calibrations came out differently.
    limit = BATCH * sum(SPEEDS) / (nominal_ms / 1e3) if nominal_ms else None
    return {
        "status": s.status,
        "samples_per_s": s.samples_per_s,
        "nominal_step_ms": nominal_ms,
        "rig_efficiency": s.samples_per_s / limit if limit and s.samples_per_s else None,
        "per_rank_batch_share": list(s.per_rank_batch_share),
        "idle_fraction": list(s.idle_fraction),
        "data_wait_fraction": [t.get("data_wait_fraction") for t in tele],
        "pace_overrun_fraction": [t.get("pace_overrun_fraction") for t in tele],
        "final_loss": s.final_loss,
        "total_s": time.perf_counter() - t0,
    }


def plain_run(variant: str, epochs: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from bench.common import WORKLOADS, ModelFactory, OptimFactory, step_fn

    spec = VARIANTS[variant]
    torch.manual_seed(SEED)
    model = ModelFactory("lenet")()
    optimizer = OptimFactory(WORKLOADS["lenet"].optimizer)(model.parameters())
    step = step_fn("lenet")
    loader = DataLoader(
        _dataset(spec["work_ms"])(), batch_size=BATCH, shuffle=True,
        num_workers=spec["workers"], persistent_workers=True,
    )  # fmt: skip
    samples, t0, loss = 0, None, float("nan")
    for _ in range(epochs):
        for batch in loader:
            if t0 is None:  # from the first batch, like flodl's Ready: worker start excluded
                t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            value = step(model, batch)
            value.backward()
            optimizer.step()
            loss = float(value.detach())
            samples += len(batch[1])
    assert t0 is not None
    return {"status": "ok", "samples_per_s": samples / (time.perf_counter() - t0),
            "final_loss": loss}  # fmt: skip


def run_one(payload: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    variant, epochs = payload["variant"], payload["epochs"]
    load_before = os.getloadavg()
    plain = VARIANTS[variant].get("plain", False)
    margin = payload.get("pace_margin", PACE_MARGIN)
    result = plain_run(variant, epochs) if plain else flodl_run(variant, epochs, margin)
    return result | {"load_before": load_before, "load_after": os.getloadavg()}


def _median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    return median([r[key] for r in rows if r.get(key)])


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, rows in runs.items():
        ok = [r for r in rows if r.get("status") == "ok"]
        shares = [r["per_rank_batch_share"][0] for r in ok if r.get("per_rank_batch_share")]
        out[variant] = {
            "runs": len(rows),
            "ok": len(ok),
            "samples_per_s": median([r["samples_per_s"] for r in ok]),
            "nominal_step_ms": _median_of(ok, "nominal_step_ms"),
            "rig_efficiency": _median_of(ok, "rig_efficiency"),
            "fast_share": median(shares) if len(SPEEDS) > 1 and shares else None,
            "data_wait_fraction": (ok[len(ok) // 2].get("data_wait_fraction") if ok else None),
            "pace_overrun_fraction": (
                ok[len(ok) // 2].get("pace_overrun_fraction") if ok else None
            ),
        }
    tensor = out["tensor"]["samples_per_s"]
    plain = out["plain_dl2"]["samples_per_s"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out["goals"] = {
        "w1_vs_tensor": ratio(out["work0.1_w1"]["samples_per_s"], tensor),
        # The same, each run against its own nominal step: the data path without the noise of
        # the calibration (T differs run to run on a shared VM; samples/s scale with 1 / T).
        "w1_vs_tensor_same_step": ratio(
            out["work0.1_w1"]["rig_efficiency"], out["tensor"]["rig_efficiency"]
        ),
        "w0_vs_tensor": ratio(out["work0.1_w0"]["samples_per_s"], tensor),
        "w1_fast_share": out["work0.1_w1"]["fast_share"],
        "work1_vs_plain_dl2": ratio(out["work1_w1"]["samples_per_s"], plain),
        "work1_w2_vs_plain_dl2": ratio((out.get("work1_w2") or {}).get("samples_per_s"), plain),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    exit_on_sigterm()
    if child_main(argv, run_one):
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.loader", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the 4,000 images")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 epoch")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--max-wait", type=float, default=10.0, help="wait for a quiet machine")
    parser.add_argument("--out", default="loader", help="results file stem under bench/results")
    parser.add_argument(
        "--pace-margin", type=float, default=PACE_MARGIN,
        help="the rig's cluster.pace_margin (T = margin x the slowest calibrated step)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    repeats, epochs = (1, 1) if args.quick else (args.repeats, args.epochs)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rep in range(repeats):
        for variant in VARIANTS:  # interleaved: drift on the machine hits every variant
            quiet = wait_quiet(0.5, args.max_wait)
            payload = {"variant": variant, "epochs": epochs, "pace_margin": args.pace_margin}
            result = run_isolated("bench.loader", payload, args.timeout) | quiet
            runs[variant].append(result)
            log(f"[{rep + 1}/{repeats}] {variant}: {result.get('samples_per_s')} samples/s")
    data = {
        "machine": machine() | {"load_average_end": list(os.getloadavg())},
        "command": "python -m bench.loader"
        + (" --quick" if args.quick else "")
        + (f" --pace-margin {args.pace_margin:g}" if args.pace_margin != PACE_MARGIN else "")
        + (f" --out {args.out}" if args.out != "loader" else ""),
        "pace_margin": args.pace_margin,
        "quick": args.quick,
        "epochs": epochs,
        "repeats": repeats,
        "batch_size": BATCH,
        "speeds": SPEEDS,
        "summary": summarize(runs),
        "runs": runs,
    }
    path = write_result(args.out, data)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
