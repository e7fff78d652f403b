"""One rank of the torch DDP baseline of bench/ddp_bench.py, for any composed run config.

Built from the same validated config as the flodl runs (``flodl.cli.app`` factories: model,
optimizer, dataset, scheduler; the task's step and eval), so the only difference is who
averages: ``DistributedDataParallel`` over gloo, gradients all-reduced every step, equal shards
of flodl's per-epoch permutation (``epoch_permutation(n, seed, epoch)``). Pacing is flodl's:
``T`` = ``pace_margin`` x the MAX over ranks of the median of ``warmup_steps`` timed steps on a
throwaway copy; each step ends at ``start + T / speed``. The LR is scaled by flodl's rule
(``trainer.lr_scale_ratio``: lr x (1 + (world - 1) x ratio)), before the scheduler reads it.
Rank 0 evaluates after every epoch (the others wait at a barrier) and writes the result.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _scheduler(run_cfg: Any, optimizer: Any, total_steps: int) -> tuple[Any, bool]:
    """The config's LR scheduler (``total_steps: auto`` = this run's optimizer steps) and
    whether it advances per step (``interval: step``) rather than per epoch."""
    from flodl.cli.app import build_scheduler

    if run_cfg.scheduler is None:
        return None, False
    scheduler = build_scheduler(run_cfg.scheduler, optimizer, total_steps)
    return scheduler, run_cfg.scheduler.interval == "step"


def evaluator(run_cfg: Any, val_x: Any, val_y: Any) -> Any:
    """``fn(model) -> float``: the task's ``eval_metric`` over the whole validation split, as
    flodl's evaluation computes it (the same ``EvalSpec``: eval_fn, or metrics + eval_loss)."""
    from flodl.cli.app import evaluation_kwargs
    from flodl.step import evaluation

    task = run_cfg.task
    spec = evaluation.EvalSpec(**evaluation_kwargs(task), eval_fn_name=task.eval_metric)
    batch = run_cfg.trainer.batch_size

    def evaluate(model: Any) -> float:
        batches = [
            (val_x[i : i + batch], val_y[i : i + batch]) for i in range(0, len(val_y), batch)
        ]
        values = evaluation.merge([evaluation.evaluate(model, batches, spec, "cpu")])
        name = evaluation.primary_name(values, task.eval_metric)
        assert name is not None, f"task {task.eval_metric!r}: nothing evaluated"
        return float(values[name])

    return evaluate


def scaled_optimizer(run_cfg: Any, params: Any, world: int) -> Any:
    """The config's optimizer, its LR scaled by flodl's rule for ``world`` ranks
    (``trainer.lr_scale_ratio``), before a scheduler reads its base LRs."""
    from flodl.cli.app import build_optimizer
    from flodl.preflight.launch import lr_scaling

    optimizer = build_optimizer(run_cfg.optimizer, params)
    factor = lr_scaling(None, run_cfg.trainer.lr_scale_ratio, world)["factor"]
    for group in optimizer.param_groups:
        group["lr"] *= factor
    return optimizer


def worker(
    rank: int, plain: dict[str, Any], speeds: list[float], rendezvous: str, out: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flodl.cli.app import build_dataset, build_model, build_optimizer
    from flodl.config import resolve_dotted, validate_run_config
    from flodl.data.source import epoch_permutation
    from flodl.rig import links
    from flodl.rig.pacing import Pacer, measure_step_s

    run_cfg = validate_run_config(plain)
    torch.set_num_threads(run_cfg.cluster.threads_per_rank or 1)
    world, batch, seed = len(speeds), run_cfg.trainer.batch_size, run_cfg.trainer.seed
    epochs = run_cfg.trainer.num_epochs
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        torch.manual_seed(seed)
        model = build_model(run_cfg.model, torch.device("cpu"))
        model.train()
        train_step = resolve_dotted(run_cfg.task.train_step)
        inputs, target = build_dataset(run_cfg.dataset, "train").tensors
        val_x, val_y = build_dataset(run_cfg.dataset, "test").tensors
        evaluate = evaluator(run_cfg, val_x, val_y)
        n = len(target)

        dist.barrier()  # calibrate together, as flodl's ranks do
        probe = copy.deepcopy(model)
        probe_opt = build_optimizer(run_cfg.optimizer, probe.parameters())
        warm = run_cfg.cluster.warmup_steps
        first = epoch_permutation(n, seed, 0)[: batch * warm]
        probe_batches = itertools.cycle([(inputs[i], target[i]) for i in first.split(batch)])

        def probe_step() -> None:
            probe_opt.zero_grad(set_to_none=True)
            train_step(probe, next(probe_batches)).backward()
            probe_opt.step()

        step_s = torch.tensor([measure_step_s(probe_step, warm)], dtype=torch.float64)
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
        nominal = float(step_s.item()) * run_cfg.cluster.pace_margin
        pacer = Pacer(speeds[rank])
        pacer.set_nominal(nominal)

        ddp = DistributedDataParallel(model)
        link = links.model_for(run_cfg.cluster.link)
        if link is not None:  # the same modelled wire flodl's ranks cross (flodl/rig/links.py)
            links.install(link)
            ddp.register_comm_hook(None, links.ddp_comm_hook(world))
        optimizer = scaled_optimizer(run_cfg, ddp.parameters(), world)
        shard_lo, shard_hi = rank * n // world, (rank + 1) * n // world
        steps_per_epoch = len(range(0, shard_hi - shard_lo, batch))
        scheduler, per_step = _scheduler(run_cfg, optimizer, epochs * steps_per_epoch)
        max_norm = run_cfg.trainer.max_grad_norm

        def train_batch(x: torch.Tensor, y: torch.Tensor) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(ddp, (x, y))
            loss.backward()
            if max_norm:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
            optimizer.step()
            if scheduler is not None and per_step:
                scheduler.step()
            return float(loss.detach())

        curve: list[list[float]] = []
        steps, samples, loss_sum = 0, 0, 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for epoch in range(epochs):
            shard = epoch_permutation(n, seed, epoch)[shard_lo:shard_hi]
            epoch_loss = 0.0
            for idx in shard.split(batch):
                x, y = inputs[idx], target[idx]
                epoch_loss += pacer.run(lambda x=x, y=y: train_batch(x, y))
                steps += 1
                samples += len(idx)
            loss_sum = epoch_loss
            if scheduler is not None and not per_step:
                scheduler.step()
            if rank == 0:
                curve.append([time.perf_counter() - t0, epoch, evaluate(ddp.module)])
            dist.barrier()
        train_s = time.perf_counter() - t0
        counts = torch.tensor([samples, steps], dtype=torch.float64)
        dist.all_reduce(counts)
        if rank == 0:
            result = {
                "status": "ok",
                "final_loss": loss_sum / max(steps_per_epoch, 1),
                "eval": curve[-1][2],
                "train_s": train_s,
                "syncs": steps,
                "samples": int(counts[0].item()),
                "samples_per_s": counts[0].item() / train_s,
                "nominal_step_ms": nominal * 1000.0,
                "curve": curve,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    # Finished: no interpreter finalization (a gloo abort there; see bench/ddp.py's _worker).
    from flodl.runtime.rank.process import end_process

    end_process(0)
