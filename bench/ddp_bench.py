"""The ddp-bench grid (docs/design/ddp-bench.md): seven workloads x solo, the five modes and
torch DDP.

    .venv/bin/python -m bench.ddp_bench                         # the whole grid (hours here)
    .venv/bin/python -m bench.ddp_bench --workloads char_rnn gpt_nano
    .venv/bin/python -m bench.ddp_bench --quick                 # smoke: tiny data, few epochs
    .venv/bin/python -m bench.ddp_bench --anchor                # gpt_nano at nanoGPT's settings

Every flodl run trains exactly the config ``python run.py experiment=ddp_bench workload=W
elche=M`` composes (conf/workload/W.yaml states W's epoch scaling; the rig is [1.0, 0.4], no LR
scaling unless ``--override trainer.lr_scale_ratio=R``, which torch DDP then applies too),
through the same factories as ``run.py``, each in a fresh process. Variants: ``solo-fast`` /
``solo-slow`` (one rank paced at 1.0 / 0.4), the five modes on the 2-rank rig, and ``ddp``:
``DistributedDataParallel`` over gloo on the same rig (equal shards of flodl's per-epoch
permutation, flodl's deadline pacing, the same model, optimizer, scheduler, step and eval built
from the same config). Validation is evaluated after every epoch; its arrival time since the
end of calibration gives the val-loss-against-wall-time curves. ``--quick`` shrinks the data
and epochs (``QUICK``) and writes ``ddp_bench_quick.json``: a proof that the grid runs end to
end, not a measurement. ``--anchor`` trains gpt_nano at nanoGPT's baby-GPT settings for its
tokens (``ANCHOR``) into ``ddp_bench_anchor.json``. ``python -m bench.render`` turns the JSON
into docs/benchmarks/index.md tables and one PNG per language model
(bench/results/<stem>_<workload>.png).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.common import (
    MODES,
    REPO,
    RESULTS,
    child_main,
    exit_on_sigterm,
    log,
    machine,
    run_isolated,
    wait_quiet,
    write_result,
)

WORKLOADS = ("logistic", "mlp", "lenet", "conv_ae", "resnet", "char_rnn", "gpt_nano")
LANGUAGE_MODELS = ("char_rnn", "gpt_nano")
RIG = (1.0, 0.4)
FIXED_ANCHOR = 20  # diloco / fixed_cadence: the slow rank's batches per window (bench.hetero's)
#: Baselines that are flodl configurations (what each is: bench.common.variant_elche): DiLoCo
#: (equal inner steps, outer Nesterov, ElChe off) and speed-proportional local steps at a fixed
#: cadence; composed as ``elche=nccl_cadence`` plus these knobs as Hydra overrides.
BASELINES = ("diloco", "fixed_cadence")
_BASELINE_KNOBS = ("anchor", "min_anchor", "max_anchor", "meta_controller", "partition_ratios",
                   "outer", "guard")  # fmt: skip


def baseline_overrides(variant: str) -> list[str]:
    """``variant_elche``'s knobs for a baseline on the rig, as Hydra overrides."""
    import json
    from enum import Enum

    from bench.common import variant_elche

    elche = variant_elche(variant, list(RIG), FIXED_ANCHOR)
    out = []
    for key in _BASELINE_KNOBS:
        value = getattr(elche, key)
        value = value.value if isinstance(value, Enum) else value
        out.append(f"elche.{key}={json.dumps(value).replace(' ', '')}")
    return out


VARIANTS = ("solo-fast", "solo-slow", "ddp", *MODES, *BASELINES)
_LM_QUICK = [
    "trainer.num_epochs=3",
    "trainer.batch_size=16",
    "dataset.block_size=32",
    "dataset.max_chars=11000",
]
# --quick: a few steps per workload (overrides on top of the workload's own config)
QUICK: dict[str, list[str]] = {
    "logistic": ["trainer.num_epochs=1"],
    "mlp": ["trainer.num_epochs=1"],
    "lenet": ["trainer.num_epochs=1"],
    "conv_ae": ["trainer.num_epochs=1"],
    "resnet": ["trainer.num_epochs=1", "dataset.n_train=256", "dataset.n_test=64"],
    # batch 16 x block 32 (not 64 x 64): a step costs ~1/8, ~10 steps per rank and epoch
    "char_rnn": _LM_QUICK,
    "gpt_nano": _LM_QUICK,
}


# --anchor: nanoGPT's CPU "baby GPT" (4 layers, 4 heads, d128, block 64, batch 12, 2,000
# iterations, val ~1.88 on tiny-shakespeare) as gpt_nano trains it: batch 12, Adam 1e-3 with
# betas (0.9, 0.99), 5 % (100 of 2,000 steps) warm-up then cosine to 1e-4, gradients clipped at
# 1.0, on 2 epochs of the offline corpus's first 853,340 characters (768,006 train = 12,000
# windows of 64): 1,536,000 tokens, the baby GPT's 2,000 x 12 x 64 (it samples 1.5 epochs of
# tiny-shakespeare's 1.0 M train characters). nanoGPT's AdamW weight decay (0.1, matrices only)
# is left out: the recipe's optimizer is Adam.
ANCHOR = [
    "trainer.batch_size=12",
    "dataset.max_chars=853340",
    "trainer.num_epochs=2",
    "optimizer.lr=0.001",
    "+optimizer.betas=[0.9,0.99]",
    "scheduler.warmup_fraction=0.05",
    "scheduler.floor=0.1",
    "trainer.max_grad_norm=1.0",
]


# --- the config a variant trains ----------------------------------------------------------------


def compose_config(workload: str, variant: str, extra: list[str]) -> dict[str, Any]:
    """The resolved config of ``run.py experiment=ddp_bench workload=W elche=M`` + overrides."""
    from hydra import compose, initialize_config_dir

    from flodl.cli.app import plain_config

    mode = "solo" if variant.startswith("solo") or variant == "ddp" else variant
    baseline = baseline_overrides(variant) if variant in BASELINES else []
    mode = "nccl_cadence" if baseline else mode
    overrides = ["experiment=ddp_bench", f"workload={workload}", f"elche={mode}", *baseline, *extra]
    if variant == "solo-fast":
        overrides += [f"cluster.speeds=[{RIG[0]}]", "cluster.ranks=1"]
    elif variant == "solo-slow":
        overrides += [f"cluster.speeds=[{RIG[1]}]", "cluster.ranks=1"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return plain_config(compose(config_name="config", overrides=overrides))


# --- one flodl run ------------------------------------------------------------------------------


def run_flodl_config(plain: dict[str, Any]) -> dict[str, Any]:
    """Train one composed config with flodl; the summary plus the per-epoch val curve."""
    import tempfile
    from functools import partial

    from bench.common import _probe_calibration
    from flodl.cli.app import (
        build_dataset,
        build_model,
        build_optimizer,
        build_scheduler,
        evaluation_kwargs,
    )
    from flodl.config import LoggerConfig, resolve_dotted, validate_run_config
    from flodl.trainer import Trainer

    run_cfg = validate_run_config(plain)
    task = run_cfg.task
    quiet = LoggerConfig(progress="off", tensorboard=False, level="WARNING")
    config = run_cfg.trainer_config().with_(logger=quiet.model_dump())
    calibrated: list[dict[str, Any]] = []
    _probe_calibration(calibrated)
    evals: list[tuple[float, int, float]] = []

    def on_eval(epoch: int, value: float) -> None:
        evals.append((time.perf_counter(), epoch, float(value)))

    scheduler = run_cfg.scheduler
    with tempfile.TemporaryDirectory(prefix="flodl-ddp-bench-") as tmp:
        t0 = time.perf_counter()
        handle = Trainer.run(
            partial(build_model, run_cfg.model),
            partial(build_optimizer, run_cfg.optimizer),
            resolve_dotted(task.train_step),
            config,
            dataset=partial(build_dataset, run_cfg.dataset, "train"),
            eval_dataset=partial(build_dataset, run_cfg.dataset, "test"),
            **evaluation_kwargs(task),  # as run.py evaluates: eval_fn or metrics + eval_loss
            eval_result_fn=on_eval,
            scheduler_factory=partial(build_scheduler, scheduler) if scheduler else None,
            scheduler_interval=scheduler.interval if scheduler else "epoch",
            job_dir=tmp,
            eval_metric=task.eval_metric,
        )
        handle.join()
        total_s = time.perf_counter() - t0
        s = handle.result.summary
    start = calibrated[-1]["wall"] if calibrated else t0
    # the calibrated step the ranks were paced at (Ready.step_ms, after the MAX all-reduce; 0.0
    # when nothing was paced) x the margin: what torch DDP's rows record, for T-matching
    steps_ms = [c["step_ms"] for c in calibrated if c.get("step_ms")]
    nominal_ms = max(steps_ms) * run_cfg.cluster.pace_margin if steps_ms else None
    train_s = s.samples_seen / s.samples_per_s if s.samples_per_s else None
    return {
        "status": s.status,
        "final_loss": s.final_loss,
        "eval": s.eval_value,
        "total_s": total_s,
        "train_s": train_s,
        "syncs": s.syncs if s.world_size > 1 else 0,
        "mean_sync_ms": s.mean_sync_ms,
        "samples": s.samples_seen,
        "samples_per_s": s.samples_per_s,
        "idle_fraction": list(s.idle_fraction),
        "per_rank_batch_share": list(s.per_rank_batch_share),
        "curve": [[t - start, epoch, value] for t, epoch, value in evals],
        "nominal_step_ms": nominal_ms,
    }


# --- one torch DDP run --------------------------------------------------------------------------


def run_ddp_config(plain: dict[str, Any], speeds: list[float]) -> dict[str, Any]:
    """The same composed config with ``DistributedDataParallel`` on the paced rig."""
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from bench.ddp_worker import worker

    with tempfile.TemporaryDirectory(prefix="flodl-ddp-bench-ddp-") as tmp:
        out = Path(tmp) / "rank0.json"
        t0 = time.perf_counter()
        mp.spawn(
            worker,
            args=(plain, list(speeds), f"file://{Path(tmp) / 'rendezvous'}", str(out)),
            nprocs=len(speeds),
            join=True,
        )
        result = json.loads(out.read_text())
    result["total_s"] = time.perf_counter() - t0
    return result


def run_one(payload: dict[str, Any]) -> dict[str, Any]:
    """One measured run, in its own process (``--one``)."""
    plain = compose_config(payload["workload"], payload["variant"], payload["extra"])
    if payload["variant"] == "ddp":
        return run_ddp_config(plain, list(RIG))
    return run_flodl_config(plain)


# --- the grid -----------------------------------------------------------------------------------


def _describe(workload: str, extra: list[str]) -> dict[str, Any]:
    """What a workload's runs train: epochs, samples and (LMs) characters per epoch."""
    from flodl.cli.app import build_dataset
    from flodl.config import validate_run_config

    run_cfg = validate_run_config(compose_config(workload, "solo-fast", extra))
    train = build_dataset(run_cfg.dataset, "train")
    info: dict[str, Any] = {
        "model": run_cfg.model.target,
        "dataset": run_cfg.dataset.target,
        "optimizer": {"target": run_cfg.optimizer.target, **run_cfg.optimizer.kwargs()},
        "scheduler": run_cfg.scheduler.model_dump(by_alias=True) if run_cfg.scheduler else None,
        "epochs": run_cfg.trainer.num_epochs,
        "batch_size": run_cfg.trainer.batch_size,
        "train_samples": len(train),
        "eval_metric": run_cfg.task.eval_metric,
        "higher_is_better": run_cfg.task.eval_higher_is_better,
        "pace_margin": run_cfg.cluster.pace_margin,
        "lr_scale_ratio": run_cfg.trainer.lr_scale_ratio,
    }
    if hasattr(train, "block_size"):
        info["block_size"] = train.block_size
        info["tokens_per_epoch"] = len(train) * train.block_size
    return info


def _variants(rows: list[dict[str, Any]]) -> list[str]:
    """The variants ``rows`` hold, in the grid's order."""
    held = {r["variant"] for r in rows}
    return [v for v in VARIANTS if v in held]


def _provenance(command: str, info: dict[str, Any]) -> dict[str, Any]:
    return {"command": command, "date": info["date"], "load_average": info.get("load_average")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if child_main(argv, run_one):
        return 0
    exit_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.ddp_bench", description=__doc__)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny data (QUICK)")
    parser.add_argument(
        "--anchor", action="store_true", help="gpt_nano at nanoGPT's baby-GPT settings (ANCHOR)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--quiet-cores", type=float, default=0.6)
    parser.add_argument("--max-wait", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="results stem (ddp_bench[_quick])")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the results file's rows this run does not redo (other workloads or variants)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override for every cell (after the workload's; e.g. trainer.num_epochs=6)",
    )
    parser.add_argument(
        "--rank-batch",
        type=int,
        default=None,
        metavar="N",
        help="the 2-rank cells' (and torch DDP's) per-rank batch; solo keeps the workload's "
        "(e.g. half of it: equal global batch, as many optimizer steps as solo)",
    )
    args = parser.parse_args(argv)
    if args.rank_batch is not None and args.rank_batch < 1:
        parser.error(f"--rank-batch {args.rank_batch}: must be >= 1")
    if args.anchor and (args.quick or args.workloads != list(WORKLOADS)):
        parser.error("--anchor trains gpt_nano at its own settings: no --quick, no --workloads")
    if args.anchor:
        args.workloads = ["gpt_nano"]
    out = args.out or (
        "ddp_bench_quick" if args.quick else "ddp_bench_anchor" if args.anchor else "ddp_bench"
    )
    info = machine()
    command = "python -m bench.ddp_bench " + " ".join(argv)
    run = _provenance(command, info)  # each row says which run measured it (--merge mixes)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    workloads: dict[str, Any] = {}
    merged_from: list[dict[str, Any]] = []
    if args.merge and (RESULTS / f"{out}.json").exists():
        old = json.loads((RESULTS / f"{out}.json").read_text())
        redo = {(w, v) for w in args.workloads for v in args.variants}
        rows = [
            {"run": _provenance(old["command"], old["machine"]), **r}  # older rows: the file's
            for r in old["rows"]
            if (r["workload"], r["variant"]) not in redo
        ]
        workloads = {
            w: d for w, d in old["settings"]["workloads"].items() if w not in args.workloads
        }
        # where the kept rows came from: every earlier command and its machine
        merged_from = [
            *old["settings"].get("merged_from", []),
            {
                "command": old["command"],
                "machine": old["machine"],
                "workloads": sorted({r["workload"] for r in rows}),
                "variants": _variants(rows),
            },
        ]
    for workload in args.workloads:
        preset = QUICK[workload] if args.quick else ANCHOR if args.anchor else []
        extra = [*preset, *args.override]
        workloads[workload] = {
            **_describe(workload, extra),
            "overrides": extra,
            "rank_batch": args.rank_batch,
        }
        for variant in args.variants:
            quiet = wait_quiet(args.quiet_cores, args.max_wait)
            cell = extra
            if args.rank_batch is not None and not variant.startswith("solo"):
                cell = [*extra, f"trainer.batch_size={args.rank_batch}"]
            payload = {"workload": workload, "variant": variant, "extra": cell}
            res = run_isolated("bench.ddp_bench", payload, args.timeout)
            rows.append({"workload": workload, "variant": variant, "run": run, **quiet, **res})
            if res.get("status") == "ok":
                log(
                    f"{workload:<9} {variant:<12} loss {res['final_loss']:.4f}  "
                    f"eval {res['eval']:.4f}  total {res['total_s']:6.1f} s  "
                    f"syncs {res['syncs']}"
                )
            else:
                log(f"{workload:<9} {variant:<12} FAILED: {res.get('error')}")
                log(str(res.get("log", ""))[-2000:])
        info["load_average_end"] = list(os.getloadavg())
        data = {
            "benchmark": "ddp_bench",
            "machine": info,
            "settings": {
                "rig": list(RIG),
                "quick": args.quick,
                # this run's (one experiment, the same overrides): 0 unless overridden
                "lr_scale_ratio": workloads[args.workloads[0]]["lr_scale_ratio"],
                "rank_batch": args.rank_batch,
                "workloads": workloads,
                "variants": _variants(rows),  # the kept rows' and this run's
                "bench_wall_s": time.perf_counter() - started,
                "merged_from": merged_from,
            },
            "command": command,
            "rows": rows,
        }
        path = write_result(out, data)  # after every workload: a cut-short run keeps its rows
    log(f"wrote {path}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
