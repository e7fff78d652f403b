"""Non-finite values never leave a rank (issue 41, item 1): a step whose loss is finite but whose
gradients are NaN, once on one rank, is skipped and counted; no rank, average or bundle ever
holds NaN. Real processes over gloo on the CPU rig."""

from __future__ import annotations

import itertools
import json
import os
from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.results import TrainedState
from flodl.checkpoint.shards import load_shard
from flodl.runtime.controller.snapshots import ResumePoint

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow

_CALLS = itertools.count()
_POISONED_CALL = 14  # calibration takes 1 + warmup_steps calls; this one is well into training


def nan_gradient_once(model: torch.nn.Module, batch) -> torch.Tensor:
    """``classification_step`` whose loss stays finite, but whose gradient is NaN once, at
    rank 1's 15th step (a sqrt at 0 in a user's loss does this)."""
    x, y = batch
    logits = model(x)
    if os.environ.get("FLODL_RANK") == "1" and next(_CALLS) == _POISONED_CALL:
        logits.register_hook(lambda g: torch.full_like(g, float("nan")))
    return torch.nn.functional.cross_entropy(logits, y)


def _run(tmp_path, mode: str, **trainer):
    builder = (
        Trainer.builder(model_factory, optim_factory, nan_gradient_once)
        .batch_size(32)
        .num_epochs(3)
        .elche(ElCheConfig(mode=mode))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    stem = str(tmp_path / "ckpt" / "run")
    cfg = builder.build_config().with_(save_path=stem, checkpoint_every=1, **trainer)
    handle = Trainer.run(
        model_factory,
        optim_factory,
        nan_gradient_once,
        cfg,
        dataset=partial(data, "train", 768),
        job_dir=tmp_path / "job",
    )
    return handle, handle.join(timeout=240), stem


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@pytest.mark.parametrize(
    ("mode", "trainer"),
    [
        ("nccl_cadence", {}),
        ("nccl_sync", {}),
        ("cpu_async", {}),
        ("nccl_cadence", {"max_grad_norm": 1.0}),  # clipping used to spread the NaN as well
        ("nccl_cadence", {"precision": "bf16-mixed"}),
    ],
)
def test_a_nan_gradient_on_one_rank_is_skipped_and_never_spreads(tmp_path, mode, trainer):
    handle, state, stem = _run(tmp_path, mode, **trainer)
    summary = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["lost_ranks"] == []
    assert summary["epochs"] == 3
    rank1 = (handle.job_dir / "rank_1.log").read_text()
    assert "rank 1: non-finite gradients in epoch" in rank1
    assert "step skipped (1 of 10 allowed)" in rank1
    skipped_elsewhere = (handle.job_dir / "rank_0.log").read_text().count("step skipped")
    # nccl_sync all-reduces gradients in the step: rank 0 skips the same step, no other
    assert skipped_elsewhere == (1 if mode == "nccl_sync" else 0)
    assert _finite(state.state_dict().values())
    assert _finite(TrainedState.load(handle.job_dir / "model.pt").state_dict().values())
    point = ResumePoint.load(stem)  # refuses a non-finite bundle: loading is itself a check
    model = load_shard(point.restore_for(0).model)
    assert _finite([*model["params"].values(), *model["buffers"].values()])
    assert point.meta.epoch == 3


_WRITES = itertools.count()


def nan_weights_in_epoch_two(model: torch.nn.Module, batch) -> torch.Tensor:
    """A step that writes NaN into rank 1's weights itself (no gradient involved), in its
    second epoch: after the epoch-1 bundle was committed."""
    if os.environ.get("FLODL_RANK") == "1" and next(_WRITES) == 20:
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def test_non_finite_weights_fail_the_job_naming_the_rank_and_keep_the_good_bundle(tmp_path):
    from flodl.runtime.controller.controller import RunFailed

    builder = (
        Trainer.builder(model_factory, optim_factory, nan_weights_in_epoch_two)
        .batch_size(32)
        .num_epochs(4)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    stem = str(tmp_path / "ckpt" / "run")
    # max_nonfinite high: the NaN weights' NaN losses must not stop it first (they would,
    # naming rank 1 and "loss", when a window is longer than max_nonfinite steps)
    cfg = builder.build_config().with_(save_path=stem, checkpoint_every=1, max_nonfinite=1000)
    handle = Trainer.run(
        model_factory,
        optim_factory,
        nan_weights_in_epoch_two,
        cfg,
        dataset=partial(data, "train", 768),
        job_dir=tmp_path / "job",
    )
    with pytest.raises(RunFailed, match=r"^rank 1 failed: NonFiniteError: the weights of rank 1"):
        handle.join(timeout=240)
    summary = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "weights of rank 1 are NaN/inf" in summary["error"]
    point = ResumePoint.load(stem)  # the last good bundle: finite, resumable
    assert 1 <= point.meta.epoch < 4
    model = load_shard(point.restore_for(0).model)
    assert _finite([*model["params"].values(), *model["buffers"].values()])


def test_on_rank_error_drop_drops_the_rank_whose_weights_went_non_finite(tmp_path):
    """The other design, opted into: the NaN rank is dropped, never averaged in; the others
    go on from their own average and end finite."""
    builder = (
        Trainer.builder(model_factory, optim_factory, nan_weights_in_epoch_two)
        .batch_size(32)
        .num_epochs(3)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    cfg = builder.build_config().with_(on_rank_error="drop", max_nonfinite=1000)
    handle = Trainer.run(
        model_factory,
        optim_factory,
        nan_weights_in_epoch_two,
        cfg,
        dataset=partial(data, "train", 768),
        job_dir=tmp_path / "job",
    )
    state = handle.join(timeout=240)
    summary = json.loads((handle.job_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["lost_ranks"] == [1]
    assert _finite(state.state_dict().values())
