"""Shared plumbing of the benchmarks: workloads, one flodl run, process isolation, machine facts.

Every measured run happens in a fresh interpreter (:func:`run_isolated`): no state, threads or
allocator history leak from one variant into the next, and a hung run is killed with its whole
process group. Importing this module has no side effects.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl.config.registries.modes import MODES as _MODES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# Every mode that averages, in the registry's order (flodl/config/registries/modes.py)
MODES = tuple(mode.value for mode, policy in _MODES.items() if policy.averages)


# --- workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """One model + data + step + eval + optimizer, named like the Hydra groups in conf/."""

    model: str  # class in flodl.recipes.models
    dataset: str  # function in flodl.recipes.datasets
    input_shape: tuple[int, ...]
    num_classes: int
    step: str  # function in flodl.recipes.steps
    eval_fn: str  # function in flodl.recipes.steps
    eval_metric: str
    higher_is_better: bool
    optimizer: str  # conf/optimizer/<name>.yaml
    dataset_kwargs: tuple[tuple[str, Any], ...] = ()
    model_kwargs: tuple[tuple[str, Any], ...] = ()


WORKLOADS: dict[str, Workload] = {
    "logistic": Workload(
        "Logistic", "mnist5k", (1, 28, 28), 10, "classification_step", "accuracy", "accuracy",
        True, "adam",
    ),
    "mlp": Workload(
        "MLP", "mnist5k", (1, 28, 28), 10, "classification_step", "accuracy", "accuracy", True,
        "adam",
    ),
    "lenet": Workload(
        "LeNet5", "mnist5k", (1, 28, 28), 10, "classification_step", "accuracy", "accuracy",
        True, "adam",
    ),
    "conv_ae": Workload(
        "ConvAE", "mnist5k", (1, 28, 28), 10, "reconstruction_step", "reconstruction_mse", "mse",
        False, "adam",
    ),
    # Communication-heavy (issue 16): 12.7 M parameters (784 -> 16000 -> 10), so at a small
    # batch one all-reduce of the parameters is a large share of a step (bench/comm_heavy.py).
    "mlp_wide": Workload(
        "MLP", "mnist5k", (1, 28, 28), 10, "classification_step", "accuracy", "accuracy", True,
        "adam", (), (("hidden", 16000),),
    ),
    # CIFAR-shaped synthetic data (offline); throughput only, the accuracy is not meaningful.
    "resnet": Workload(
        "ResNet20", "synthetic", (3, 32, 32), 10, "classification_step", "accuracy", "accuracy",
        True, "sgd", (("n_train", 1024), ("n_test", 256)),
    ),
}  # fmt: skip


class ModelFactory:
    """``model_factory(device)`` for a workload; importable, so it reaches ranks by reference."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, device: Any = None) -> Any:
        import flodl.recipes.models

        w = WORKLOADS[self.name]
        model = getattr(flodl.recipes.models, w.model)
        return model(list(w.input_shape), w.num_classes, **dict(w.model_kwargs))


class OptimFactory:
    """``optim_factory(params)`` from ``conf/optimizer/<name>.yaml`` (read in the launcher)."""

    def __init__(self, name: str) -> None:
        import yaml

        spec = yaml.safe_load((REPO / "conf" / "optimizer" / f"{name}.yaml").read_text())
        self.target = spec.pop("_target_")
        self.kwargs = spec

    def __call__(self, params: Any) -> Any:
        from flodl.config import resolve_dotted

        return resolve_dotted(self.target)(params, **self.kwargs)


def dataset_factory(name: str, split: str, **overrides: Any) -> Callable[[], Any]:
    """A zero-argument factory of the workload's ``split`` (each rank loads its own copy)."""
    import flodl.recipes.datasets

    w = WORKLOADS[name]
    kwargs = {**dict(w.dataset_kwargs), **overrides}
    return functools.partial(
        getattr(flodl.recipes.datasets, w.dataset),
        split,
        input_shape=list(w.input_shape),
        num_classes=w.num_classes,
        **kwargs,
    )


def step_fn(name: str) -> Callable[..., Any]:
    import flodl.recipes.steps

    return getattr(flodl.recipes.steps, WORKLOADS[name].step)


def eval_fn(name: str) -> Callable[..., float]:
    import flodl.recipes.steps

    return getattr(flodl.recipes.steps, WORKLOADS[name].eval_fn)


def evaluate_state(name: str, state_dict: dict[str, Any], **dataset_overrides: Any) -> float:
    """The workload's eval metric of a trained state on the whole test split."""
    model = ModelFactory(name)()
    model.load_state_dict(state_dict)
    inputs, target = dataset_factory(name, "test", **dataset_overrides)().tensors
    return float(eval_fn(name)(model, inputs, target))


def elche_preset(mode: str, **knobs: Any) -> Any:
    """``conf/elche/<mode>.yaml`` as an ``ElCheConfig`` (what ``run.py elche=<mode>`` gets),
    ``knobs`` on top."""
    from flodl.config import ElCheConfig

    return ElCheConfig.preset(mode, **knobs)  # the YAML states only what it changes


#: Baselines that are flodl configurations, not flodl's modes: what a variant name means.
#: ``diloco``: a fixed number of inner steps on every rank (the slow one sets the pace), then
#: an outer Nesterov step on the averaged update (DiLoCo's outer optimizer), ElChe off.
#: ``fixed_cadence``: local steps in proportion to the known speeds at a fixed cadence (the
#: "perfect ElChe without control", DyLU-style). ``<mode>_<c>``: compressed averages
#: (``nccl_cadence_int8``, ``cpu_cadence_bf16``, ``cpu_async_int8``).
def variant_elche(variant: str, speeds: Sequence[float] | None, anchor: int = 20) -> Any:
    fixed = {"anchor": anchor, "min_anchor": anchor, "max_anchor": anchor, "meta_controller": False}
    n = len(speeds) if speeds else 1
    if variant == "diloco":
        return elche_preset(
            "nccl_cadence", **fixed, partition_ratios=[1.0] * n, outer="nesterov", guard="none"
        )
    if variant == "fixed_cadence":
        ratios = list(speeds) if speeds else [1.0]
        return elche_preset("nccl_cadence", **fixed, partition_ratios=ratios, guard="none")
    mode, _, compress = variant.rpartition("_")
    if compress in ("bf16", "fp16", "int8"):  # nccl_cadence_int8, cpu_async_bf16, ...
        return elche_preset(mode, compress=compress)
    return elche_preset(variant)


# --- one flodl run --------------------------------------------------------------------------------


def _probe_calibration(sink: list[dict[str, Any]]) -> None:
    """Record each rank's calibrated step (``Ready.step_ms``, after the MAX all-reduce; 0.0 when
    nothing is paced), and the launcher's wall and CPU clocks when it arrives (the last Ready
    starts the training clock).

    Read-only: wraps ``Controller._on_ready`` in this (the launcher's) process. flodl does not
    surface the nominal step ``T`` in its summary, and it differs run to run on a shared VM.
    """
    from flodl.runtime.controller.controller import Controller

    original = getattr(Controller, "_on_ready", None)
    if original is None:  # flodl's internals moved on: T stays unknown (None), nothing breaks
        return
    if getattr(original, "_bench_probe", False):
        Controller._on_ready._bench_sink = sink  # type: ignore[attr-defined]
        return

    def on_ready(self: Any, msg: Any) -> None:
        step_ms = getattr(msg, "step_ms", None)
        on_ready._bench_sink.append(  # type: ignore[attr-defined]
            {
                "step_ms": float(step_ms) if step_ms is not None else None,
                "wall": time.perf_counter(),
                "cpu": time.process_time(),
            }
        )
        original(self, msg)

    on_ready._bench_probe = True  # type: ignore[attr-defined]
    on_ready._bench_sink = sink  # type: ignore[attr-defined]
    Controller._on_ready = on_ready  # type: ignore[method-assign]


def run_flodl(
    name: str,
    mode: str,
    *,
    epochs: int,
    batch_size: int = 64,
    speeds: Sequence[float] | None = None,
    cluster_kind: str = "cpu_rig",
    pace_margin: float = 1.3,
    seed: int = 42,
    lr_scale_ratio: float = 0.0,
    eval_every: int | None = None,
    dataset_overrides: dict[str, Any] | None = None,
    with_eval: bool = True,
    link: Any = None,
    fixed_anchor: int = 20,
    cluster_knobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``name`` once with the flodl Trainer and return what the benchmarks tabulate.
    ``cluster_knobs``: further ClusterConfig fields (memory_mb, memory_plan, ...).

    ``speeds`` of length 1 (or ``mode='solo'``) is a one-rank, in-process run. Evaluation runs
    only after the last epoch (``eval_every`` defaults to ``epochs``), outside the training time;
    ``with_eval=False`` gives flodl no eval set at all (the bench still scores the final state).
    """
    from flodl import ClusterConfig, LoggerConfig, Trainer, TrainerConfig

    overrides = dataset_overrides or {}
    if cluster_kind == "cpu_rig":
        assert speeds is not None
        cluster = ClusterConfig(
            kind="cpu_rig",
            ranks=len(speeds),
            speeds=list(speeds),
            pace_margin=pace_margin,
            link=link or "none",
            **(cluster_knobs or {}),
        )
    else:
        cluster = ClusterConfig(kind="auto")
    calibrated: list[dict[str, Any]] = []
    _probe_calibration(calibrated)
    epoch_clock: list[tuple[float, float]] = []

    def on_epoch(metrics: Any) -> None:
        epoch_clock.append((time.perf_counter(), time.process_time()))

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flodl-bench-") as tmp:
        t0 = time.perf_counter()
        optim = OptimFactory(WORKLOADS[name].optimizer)
        builder = (
            Trainer.builder(ModelFactory(name), optim, step_fn(name))
            .config(TrainerConfig(eval_every=eval_every or epochs, lr_scale_ratio=lr_scale_ratio))
            .dataset(dataset_factory(name, "train", **overrides))
        )
        if with_eval:
            builder = builder.eval_dataset(dataset_factory(name, "test", **overrides)).eval_fn(
                eval_fn(name)
            )
        handle = (
            builder.batch_size(batch_size)
            .num_epochs(epochs)
            .seed(seed)
            .elche(variant_elche(mode, speeds, fixed_anchor))
            .cluster(cluster)
            .logger(LoggerConfig(progress="off", tensorboard=False, level="WARNING"))
            .metrics_fn(on_epoch)
            .output_dir(tmp)
            .run()
        )
        state = handle.join()
        total_s = time.perf_counter() - t0
        result = handle.result
    load_after = os.getloadavg()
    s = result.summary
    train_s = s.samples_seen / s.samples_per_s if s.samples_per_s else math.nan
    sync_ms = [e.sync_ms for e in result.events]
    world = s.world_size
    rank_ms = [0.0] * world
    rank_batches = [0] * world
    for epoch in result.epochs:
        for r, per in enumerate(epoch.per_rank):
            rank_ms[r] += per["compute_ms"]
            rank_batches[r] += int(per["batches"])
    steps_ms = [c["step_ms"] for c in calibrated if c["step_ms"]]  # 0.0: nothing was paced
    step_ms = max(steps_ms) if steps_ms else None
    # CPU seconds this (the launcher's) process spent while training: the whole run for an
    # in-process solo job, the controller's share for a process-per-rank job.
    launcher_cpu_s = (
        epoch_clock[-1][1] - calibrated[-1]["cpu"] if calibrated and epoch_clock else None
    )
    paced = cluster_kind == "cpu_rig"
    return {
        "status": s.status,
        "mode": mode,
        "world_size": world,
        "speeds": list(speeds) if speeds is not None else None,
        "samples": s.samples_seen,
        "samples_per_s": s.samples_per_s,
        "train_s": train_s,
        "wall_s": s.wall_s,
        "total_s": total_s,
        "startup_s": total_s - train_s,
        "final_loss": s.final_loss,
        "eval_value": s.eval_value,
        "test_metric": evaluate_state(name, state.state_dict(), **overrides),
        "syncs": s.syncs if world > 1 else 0,
        "sync_ms_total": sum(sync_ms),
        "mean_sync_ms": s.mean_sync_ms,
        "sync_overhead": (sum(sync_ms) / 1000.0 / train_s) if world > 1 else None,
        "mean_event_overhead": statistics.fmean(e.overhead for e in result.events)
        if result.events
        else None,
        "idle_fraction": list(s.idle_fraction),
        "per_rank_batch_share": list(s.per_rank_batch_share),
        "per_rank_ms_per_batch": [
            ms / b if b else None for ms, b in zip(rank_ms, rank_batches, strict=True)
        ],
        "calibrated_step_ms": step_ms,
        "nominal_step_ms": step_ms * pace_margin if (step_ms is not None and paced) else None,
        "final_anchor": s.anchor,
        # the cpu_* modes' averaging traffic (compress, averages, up/down bytes), else None
        "averaging": s.averaging,
        "window_anchor": [e.anchor for e in result.events],
        "window_overhead": [e.overhead for e in result.events],
        "launcher_cpu_train_s": launcher_cpu_s,
        "load_before": load_before,
        "load_after": load_after,
        "memory_plans": list(s.memory_plans),
        "peak_mem_mb": [t.get("peak_mem_mb") for t in s.telemetry],
        "overrun_fraction": (s.rig or {}).get("overrun_fraction"),
    }


# --- process isolation ----------------------------------------------------------------------------


def run_isolated(module: str, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run ``python -m <module> --one '<payload json>'`` in a fresh process group.

    The child writes its result as JSON to the path given by ``--one-out``. A child that fails,
    or outlives ``timeout_s`` (then its whole group is killed), yields ``{"status": "failed"}``.
    """
    with tempfile.TemporaryDirectory(prefix="flodl-bench-run-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, "--one", json.dumps(payload), "--one-out", str(out)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            log, _ = proc.communicate()
            return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s", "log": log}
        except BaseException:  # interrupted (Ctrl-C, SIGTERM via exit_on_sigterm): no orphans
            _kill_group(proc.pid)
            raise
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(log.strip().splitlines()[-15:])
            return {"status": "failed", "error": f"exit code {proc.returncode}", "log": tail}
        return json.loads(out.read_text())


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, ``kill``) into SystemExit, so a running child is killed too."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def child_main(argv: Sequence[str], run_one: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    """Handle ``--one <json> --one-out <path>`` (the isolated child); False when not a child."""
    if "--one" not in argv:
        return False
    payload = json.loads(argv[argv.index("--one") + 1])
    out = Path(argv[argv.index("--one-out") + 1])
    result = run_one(payload)
    out.write_text(json.dumps(result, default=_json_default))
    return True


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON-serialisable: {type(obj)}")


def cpu_busy(interval_s: float = 0.5) -> float:
    """Busy cores (0..cores) of the whole machine over ``interval_s``, from /proc/stat."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return math.nan
    span = total1 - total0
    return (os.cpu_count() or 1) * (1.0 - (idle1 - idle0) / span) if span > 0 else math.nan


def wait_quiet(threshold: float, max_wait_s: float) -> dict[str, float]:
    """Between runs, wait (up to ``max_wait_s``) until other processes use < ``threshold`` cores.

    Called while no benchmark process runs, so the busy cores are someone else's. Returns what
    was seen, for the record; it never skips a run.
    """
    t0 = time.perf_counter()
    busy = cpu_busy()
    while busy >= threshold and time.perf_counter() - t0 < max_wait_s:
        time.sleep(2.0)
        busy = cpu_busy()
    return {"others_busy_cores": busy, "waited_s": time.perf_counter() - t0}


# --- statistics -----------------------------------------------------------------------------------


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are numbers (None when there are none)."""
    nums = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(nums) if nums else None


def median_lists(rows: Sequence[Sequence[float | None] | None]) -> list[float | None] | None:
    """Element-wise median of equal-length lists (per-rank values)."""
    rows = [r for r in rows if r]
    if not rows:
        return None
    return [median([r[i] for r in rows]) for i in range(len(rows[0]))]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


# --- machine and results --------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Where the numbers came from (stored with every result file)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": list(os.getloadavg()),
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8")
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
