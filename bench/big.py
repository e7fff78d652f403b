"""A 120 M-parameter model end to end on the 2-rank CPU rig (issue 18, point 1): train 2 epochs in
nccl_cadence with Adam and a checkpoint every epoch, resume in cpu_cadence for a third, and check
that each run's model.pt, its final bundle and its TrainedState are one state, the evaluated one.

    .venv/bin/python -m bench.big                   # writes bench/results/big.json
    .venv/bin/python -m bench.big --params 30000000 # a smaller model (smoke test)

Not in the suite (the suite keeps its 72 M test, tests/integration/test_big_model.py): it takes
about 0.5 GB of parameters, Adam x4 per rank, and minutes on a loaded machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.bulk import WIDTH, _adam, _data, table_model
from bench.common import log, machine, write_result


def _run(root: Path, name: str, rows: int, mode: str, epochs: int, **trainer: Any) -> Any:
    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import accuracy, classification_step

    model = partial(table_model, rows)
    cfg = (
        Trainer.builder(model, _adam, classification_step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode, anchor=2))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 1.0], warmup_steps=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    t0 = time.perf_counter()
    handle = Trainer.run(
        model,
        _adam,
        classification_step,
        cfg,
        dataset=partial(_data, "train"),
        eval_dataset=partial(_data, "test"),
        eval_fn=accuracy,
        job_dir=root / name,
    )
    handle.join(timeout=1800)
    return handle.result, time.perf_counter() - t0


def _check(result: Any, job_dir: Path, stem: str, rows: int) -> dict[str, Any]:
    """model.pt == bundle == TrainedState, and evaluating model.pt gives the reported value."""
    import torch

    from flodl import TrainedState
    from flodl.checkpoint.bundle import load_bundle
    from flodl.recipes.steps import accuracy

    written = TrainedState.load(job_dir / "model.pt")
    payload, meta = load_bundle(stem)
    same_bundle = all(torch.equal(payload["params"][k], v) for k, v in result.state.params.items())
    same_file = all(torch.equal(written.params[k], v) for k, v in result.state.params.items())
    del payload
    gc.collect()
    model = written.load_into(table_model(rows, torch.device("cpu"))).eval()
    inputs, target = _data("test")[:]
    with torch.no_grad():
        evaluated = float(accuracy(model, inputs, target))
    return {
        "status": result.summary.status,
        "epochs": [m.epoch for m in result.epochs],
        "bundle_epoch": meta.epoch,
        "bundle_ranks": meta.extra.get("ranks"),
        "params": sum(v.numel() for v in result.state.params.values()),
        "model_pt_equals_state": same_file,
        "bundle_equals_state": same_bundle,
        "eval_value": result.summary.eval_value,
        "model_pt_eval_value": evaluated,
        "eval_matches": abs(evaluated - float(result.summary.eval_value)) <= 1e-6,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=120_000_000)
    ap.add_argument("--out", default="big")
    args = ap.parse_args(argv)
    rows = args.params // WIDTH
    out: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m bench.big", *argv]),
    }
    with tempfile.TemporaryDirectory(prefix="flodl-bench-big-") as tmp:
        root = Path(tmp)
        stem = str(root / "ckpt" / "run")
        log("first: nccl_cadence, 2 epochs, checkpoint every epoch")
        first, wall = _run(
            root, "first", rows, "nccl_cadence", 2, save_path=stem, checkpoint_every=1
        )
        out["first"] = {**_check(first, root / "first", stem, rows), "wall_s": wall}
        log(f"  {out['first']}")
        del first
        gc.collect()
        log("resumed: cpu_cadence, epoch 3")
        resumed, wall = _run(
            root, "resumed", rows, "cpu_cadence", 3, resume_from=stem, save_path=stem
        )
        out["resumed"] = {**_check(resumed, root / "resumed", stem, rows), "wall_s": wall}
        log(f"  {out['resumed']}")
    out["machine"]["load_average_end"] = list(os.getloadavg())
    log(f"wrote {write_result(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
