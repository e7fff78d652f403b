"""The plain-PyTorch baseline: DistributedDataParallel over gloo on the same paced CPU rig.

Launched the usual way (``torch.multiprocessing.spawn``), one process per rank, each with
``torch.set_num_threads(1)``. Equal shards: rank ``r`` takes the ``r``-th equal slice of the
same per-epoch permutation flodl uses (``flodl.data.source.epoch_permutation(n, seed, epoch)``),
cut into
batches of ``batch_size``. Pacing is flodl's own: ``T`` = ``pace_margin`` x the MAX over ranks of
the median of ``warmup_steps`` timed steps on a throwaway copy (``measure_step_s``, first ``B x
warmup_steps`` samples of epoch 0, as ``RankLoop.calibrate``); each step (forward, backward with
DDP's gradient all-reduce, optimizer step) runs under ``Pacer.run`` and ends at ``start +
T / speed``.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _worker(rank: int, cfg: dict[str, Any], rendezvous: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bench.startup import stamp_first_step
    from flodl.config.cluster import LinkConfig
    from flodl.data.source import epoch_permutation
    from flodl.rig import links
    from flodl.rig.device_memory import DeviceMemory, MiB, training_state
    from flodl.rig.pacing import Pacer, measure_step_s

    torch.set_num_threads(1)
    speeds = cfg["speeds"]
    world = len(speeds)
    batch, seed = cfg["batch_size"], cfg["seed"]
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        torch.manual_seed(seed)
        model, make_optim, train_step, n, batch_at, evaluate = _parts(cfg)
        model.train()

        # calibration: a throwaway copy, as flodl's RankLoop.calibrate; all ranks at once (flodl's
        # ranks start calibrating together too, right after their initial broadcast)
        dist.barrier()
        probe = copy.deepcopy(model)
        probe_opt = make_optim(probe.parameters())
        warm = cfg["warmup_steps"]
        first = epoch_permutation(n, seed, 0)[: batch * warm]
        probe_batches = itertools.cycle([batch_at(i) for i in first.split(batch)])

        def probe_step() -> None:
            stamp_first_step()  # bench/startup.py's launch -> first step (a no-op elsewhere)
            probe_opt.zero_grad(set_to_none=True)
            train_step(probe, next(probe_batches)).backward()
            probe_opt.step()

        step_s = torch.tensor([measure_step_s(probe_step, warm)], dtype=torch.float64)
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
        nominal = float(step_s.item()) * cfg["pace_margin"]
        pacer = Pacer(speeds[rank])
        pacer.set_nominal(nominal)

        ddp = DistributedDataParallel(model)
        if cfg.get("link"):  # the same modelled wire flodl's ranks cross (flodl/rig/links.py)
            links.install(links.model_for(LinkConfig.model_validate(cfg["link"])))
            ddp.register_comm_hook(None, links.ddp_comm_hook(world))
        optimizer = make_optim(ddp.parameters())
        budgets = cfg.get("memory_mb")
        # the rig's simulated device memory, as flodl's ranks get (flodl/rig/device_memory.py)
        if budgets:
            memory = DeviceMemory(int(budgets[rank] * MiB), name=f"ddp rank {rank}")
            memory.adopt(training_state(ddp.module, optimizer))
            memory.__enter__()

        def train_batch(b: Any) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(ddp, b)
            loss.backward()
            optimizer.step()
            return float(loss.detach())

        shard_lo, shard_hi = rank * n // world, (rank + 1) * n // world
        steps, samples, loss_sum = 0, 0, 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for epoch in range(cfg["epochs"]):
            shard = epoch_permutation(n, seed, epoch)[shard_lo:shard_hi]
            for idx in shard.split(batch):
                b = batch_at(idx)
                loss = pacer.run(lambda b=b: train_batch(b))
                steps += 1
                samples += len(idx)
                if epoch == cfg["epochs"] - 1:
                    loss_sum += loss
        dist.barrier()
        train_s = time.perf_counter() - t0
        counts = torch.tensor([samples, steps], dtype=torch.float64)
        dist.all_reduce(counts)
        if rank == 0:
            last_steps = len(range(0, shard_hi - shard_lo, batch))
            busy = steps * nominal / min(speeds)  # every rank steps in lock-step
            result = {
                "status": "ok",
                "samples": int(counts[0].item()),
                "samples_per_s": counts[0].item() / train_s,
                "train_s": train_s,
                "syncs": steps,
                "final_loss": loss_sum / max(last_steps, 1),
                "test_metric": evaluate(ddp.module.state_dict()),
                "calibrated_step_ms": float(step_s.item()) * 1000.0,
                "nominal_step_ms": nominal * 1000.0,
                # Nominal busy time per rank: its steps x T / speed_r (pacing is the device).
                "idle_fraction": [max(0.0, 1.0 - steps * nominal / s / train_s) for s in speeds],
                "lockstep_bound_s": busy,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # Finished: leave as flodl's ranks do, without interpreter finalization, where a gloo
    # worker thread's last reference can abort the process (SIGABRT; pytorch/pytorch#179291)
    # and fail a run whose result is written.
    from flodl.runtime.rank.process import end_process

    end_process(0)


def _parts(cfg: dict[str, Any]) -> tuple[Any, Any, Any, int, Any, Any]:
    """The model, optimizer factory, train step, sample count, ``batch_at(indices)`` and
    ``evaluate(state_dict)`` of a bench workload (bench/common.py), or of ``cfg["parts"]``
    (``"module:function"``, called with ``cfg``: a benchmark's own workload, bench/hf_lora.py)."""
    if cfg.get("parts"):
        import importlib

        module, _, function = cfg["parts"].partition(":")
        parts: tuple[Any, Any, Any, int, Any, Any] = getattr(
            importlib.import_module(module), function
        )(cfg)
        return parts
    from bench.common import ModelFactory, OptimFactory, dataset_factory, evaluate_state, step_fn

    name = cfg["workload"]
    inputs, target = dataset_factory(name, "train")().tensors
    return (
        ModelFactory(name)(),
        OptimFactory(cfg["optimizer"]),
        step_fn(name),
        len(target),
        lambda idx: (inputs[idx], target[idx]),
        lambda state: evaluate_state(name, state),
    )


def run_ddp(
    speeds: list[float],
    *,
    epochs: int,
    workload: str = "lenet",
    batch_size: int = 64,
    seed: int = 42,
    pace_margin: float = 1.3,
    warmup_steps: int = 8,
    link: str | dict[str, Any] | None = None,
    memory_mb: list[float] | None = None,
    parts: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train with DDP on the paced rig; rank 0's numbers (samples/s over all ranks). ``link``:
    a ``cluster.link`` value; every bucket's all-reduce then pays the modelled wire through a
    DDP communication hook, as flodl's collectives do. ``parts``: a benchmark's own workload
    (see :func:`_parts`; ``extra`` reaches it in the config)."""
    import torch.multiprocessing as mp

    from bench.common import WORKLOADS

    cfg = {
        "speeds": list(speeds),
        "epochs": epochs,
        "workload": workload,
        "optimizer": WORKLOADS[workload].optimizer if parts is None else None,
        "parts": parts,
        **(extra or {}),
        "batch_size": batch_size,
        "seed": seed,
        "pace_margin": pace_margin,
        "warmup_steps": warmup_steps,
        "link": {"profile": link} if isinstance(link, str) else link,
        "memory_mb": list(memory_mb) if memory_mb else None,
    }
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flodl-bench-ddp-") as tmp:
        out = Path(tmp) / "rank0.json"
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(cfg, rendezvous, str(out)), nprocs=len(speeds), join=True)
        total_s = time.perf_counter() - t0
        result = json.loads(out.read_text())
    result.update(
        mode="ddp",
        world_size=len(speeds),
        speeds=list(speeds),
        total_s=total_s,
        wall_s=total_s,
        startup_s=total_s - result["train_s"],
        eval_value=result["test_metric"],
        sync_overhead=None,
        per_rank_batch_share=[1.0 / len(speeds)] * len(speeds),
        load_before=load_before,
        load_after=os.getloadavg(),
    )
    return result


def torchrun_main(argv: list[str]) -> int:
    """One rank under torchrun: ``python -m torch.distributed.run ... -m bench.ddp --torchrun
    '<cfg json>' <out>`` (``RANK`` and the rendezvous from torchrun's environment)."""
    cfg, out = json.loads(argv[0]), argv[1]
    _worker(int(os.environ["RANK"]), cfg, "env://", out)
    return 0


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--torchrun"]:
        sys.exit(torchrun_main(sys.argv[2:]))
    sys.exit("usage: python -m torch.distributed.run ... -m bench.ddp --torchrun CFG OUT")
