"""The plain-PyTorch baseline: DistributedDataParallel over gloo on the same paced CPU rig.

Launched the usual way (``torch.multiprocessing.spawn``), one process per rank, each with
``torch.set_num_threads(1)``. Equal shards: rank ``r`` takes the ``r``-th equal slice of the
same per-epoch permutation flodl uses (``flodl.data.source.epoch_permutation(n, seed, epoch)``),
cut into
batches of ``batch_size``. Pacing is flodl's own: ``T`` = ``pace_margin`` x the MAX over ranks of
the median of ``warmup_steps`` timed steps on a throwaway copy (``measure_step_s``, first ``B x
warmup_steps`` samples of epoch 0, as ``Worker.calibrate``); each step (forward, backward with
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

    from bench.common import ModelFactory, OptimFactory, dataset_factory, evaluate_state, step_fn
    from bench.startup import stamp_first_step
    from flodl.config.cluster import LinkConfig
    from flodl.data.source import epoch_permutation
    from flodl.rig import links
    from flodl.rig.memory import DeviceMemory, MiB, training_state
    from flodl.rig.pacing import Pacer, measure_step_s

    torch.set_num_threads(1)
    speeds = cfg["speeds"]
    world = len(speeds)
    name, batch, seed = cfg["workload"], cfg["batch_size"], cfg["seed"]
    dist.init_process_group(
        "gloo",
        init_method=rendezvous,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        torch.manual_seed(seed)
        model = ModelFactory(name)()
        model.train()
        make_optim = OptimFactory(cfg["optimizer"])
        train_step = step_fn(name)
        inputs, target = dataset_factory(name, "train")().tensors
        n = len(target)

        # calibration: a throwaway copy, as flodl's Worker.calibrate; all ranks at once (flodl's
        # ranks start calibrating together too, right after their initial broadcast)
        dist.barrier()
        probe = copy.deepcopy(model)
        probe_opt = make_optim(probe.parameters())
        warm = cfg["warmup_steps"]
        first = epoch_permutation(n, seed, 0)[: batch * warm]
        probe_batches = itertools.cycle([(inputs[i], target[i]) for i in first.split(batch)])

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
        if budgets:  # the rig's simulated device memory, as flodl's ranks get (flodl/rig/memory.py)
            memory = DeviceMemory(int(budgets[rank] * MiB), name=f"ddp rank {rank}")
            memory.adopt(training_state(ddp.module, optimizer))
            memory.__enter__()

        def train_batch(x: torch.Tensor, y: torch.Tensor) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(ddp, (x, y))
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
                x, y = inputs[idx], target[idx]
                loss = pacer.run(lambda x=x, y=y: train_batch(x, y))
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
                "test_metric": evaluate_state(name, ddp.module.state_dict()),
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
) -> dict[str, Any]:
    """Train with DDP on the paced rig; rank 0's numbers (samples/s over all ranks). ``link``:
    a ``cluster.link`` value; every bucket's all-reduce then pays the modelled wire through a
    DDP communication hook, as flodl's collectives do."""
    import torch.multiprocessing as mp

    from bench.common import WORKLOADS

    cfg = {
        "speeds": list(speeds),
        "epochs": epochs,
        "workload": workload,
        "optimizer": WORKLOADS[workload].optimizer,
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
