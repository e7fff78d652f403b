"""Small, fast runs on the CPU rig for integration tests (real processes over gloo).

Every rank of a test that passes these functions imports this module to unpickle them: it
imports nothing a rank does not need (torchmetrics pulls scipy and matplotlib, ~1.3 CPU s per
rank start; test_evaluation, which needs it, imports it itself)."""

from __future__ import annotations

import itertools
import time
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.datasets import synthetic
from flodl.recipes.models import MLP
from flodl.recipes.steps import accuracy, classification_step
from flodl.runtime.cohorts import fork_server

SHAPE = [1, 8, 8]
CLASSES = 4


def data(split: str, n_train: int = 1536) -> Any:
    return synthetic(split, n_train=n_train, n_test=256, input_shape=SHAPE, num_classes=CLASSES)


def model_factory(device: torch.device) -> torch.nn.Module:
    return MLP(SHAPE, CLASSES, hidden=32).to(device)


def bn_model_factory(device: torch.device) -> torch.nn.Module:
    """A small conv net with BatchNorm (float buffers, averaged in nccl_sync's step)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * SHAPE[1] * SHAPE[2], CLASSES),
    ).to(device)


def optim_factory(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def wide(device: torch.device) -> torch.nn.Module:
    """The memory-plan tests' model: all parameters, ~1.1 M (4.3 MiB), so Adam's state is
    8.6 MiB and a plain step's state ~22 MiB, while activations at batch 32 are ~0.4 MiB."""
    nn = torch.nn
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(SHAPE[1] * SHAPE[2], 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 4),
    ).to(device)


def plan_builder(
    tmp_path: Path,
    name: str,
    mode: str,
    memory_mb: tuple[float, ...],
    plan: Any = "auto",
    n_train: int = 1536,
    epochs: int = 2,
) -> Any:
    """A builder of ``wide`` on the rig under ``memory_mb`` budgets (speeds 1.0, 0.5, 0.5)."""
    ranks = len(memory_mb)
    cluster = ClusterConfig(
        kind="cpu_rig",
        ranks=ranks,
        speeds=[1.0, 0.5, 0.5][:ranks],
        warmup_steps=2,
        memory_mb=list(memory_mb),
        memory_plan=plan,
    )
    return (
        Trainer.builder(wide, optim_factory, classification_step)
        .dataset(partial(data, "train", n_train))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode))
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / name)
    )


def small_run(
    tmp_path: Path,
    mode: str,
    ranks: int = 2,
    speeds: list[float] | None = None,
    epochs: int = 2,
    n_train: int = 1536,
    model=model_factory,
    cluster: dict[str, Any] | None = None,
    **elche: Any,
):
    """A short run on the rig; ``cluster``: further ClusterConfig knobs (link, memory_mb...)."""
    speeds = speeds if speeds is not None else [1.0, 0.5][:ranks]
    handle = (
        Trainer.builder(model, optim_factory, classification_step)
        .dataset(partial(data, "train", n_train))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode, **elche))
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=ranks, speeds=speeds, warmup_steps=3, **(cluster or {})
            )
        )
        .logger(LoggerConfig(progress="lines"))
        .output_dir(tmp_path / mode)
        .run()
    )
    state = handle.join(timeout=240)
    return handle, state


def _environ(proc: psutil.Process) -> dict[str, str]:
    """What ``proc`` runs with: a fork of the fork server shows the server's in /proc."""
    forked = fork_server.forks().get(proc.pid)
    return forked if forked is not None else proc.environ()


def is_rank_itself(proc: psutil.Process, rank: int | None = None) -> bool:
    """``proc`` is a flodl rank (``rank``, or any when None), not one of its DataLoader workers
    or other helpers: those inherit its FLODL_ROLE/FLODL_RANK, but their parent has them too."""
    try:
        env = _environ(proc)
        if env.get("FLODL_ROLE") != "rank" or (
            rank is not None and env.get("FLODL_RANK") != str(rank)
        ):
            return False
        parent = proc.parent()
        parent_env = _environ(parent) if parent is not None else {}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return (
        parent_env.get("FLODL_ROLE") != "rank" or parent_env.get("FLODL_RANK") != env["FLODL_RANK"]
    )


def rank_pid(rank: int) -> int:
    """The pid of this test's rank ``rank`` (a local child), never one of its loader workers."""
    for proc in psutil.Process().children(recursive=True):
        if is_rank_itself(proc, rank):
            return proc.pid
    raise LookupError(f"no process for rank {rank}")


_STEPS = itertools.count()


def late_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``classification_step`` that takes 20 ms longer from its 5th call in a process on: the
    calibration (1 + 3 warm-up steps) times a fast step, training then overruns every paced
    deadline, as a rank on oversubscribed cores does."""
    if next(_STEPS) >= 4:
        time.sleep(0.02)
    return classification_step(model, batch)
