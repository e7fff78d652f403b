"""A bug in user code fails the job; it is not a lost device (issue 41, item 3).

An exception raised by the user's train step or eval step fails the job with that exception,
its rank and the user's file:line, at once (no regroup cascade); ``trainer.on_rank_error=drop``
loses the rank instead, as a lost device."""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import classification_step
from flodl.runtime.controller.controller import RunFailed

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow

_CALLS = itertools.count()


def buggy_step(model: torch.nn.Module, batch) -> torch.Tensor:
    """Trains a few steps (calibration included), then a deterministic bug, on every rank."""
    if next(_CALLS) >= 8:
        raise ValueError("logits and targets disagree: (32, 4) vs (32,)")
    return classification_step(model, batch)


def rank1_bug(model: torch.nn.Module, batch) -> torch.Tensor:
    if os.environ.get("FLODL_RANK") == "1" and next(_CALLS) >= 8:
        raise ValueError("rank 1's own bad batch")
    return classification_step(model, batch)


def buggy_eval_step(model: torch.nn.Module, batch):
    sample = {"x": batch[0], "y": batch[1]}
    return model(sample[0]), sample["y"]  # the KeyError: 0 of dict samples


def _run(tmp_path, step, mode="nccl_cadence", epochs=2, eval_step=None, **trainer):
    builder = (
        Trainer.builder(model_factory, optim_factory, step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    cfg = builder.build_config().with_(**trainer)
    extra = {}
    if eval_step is not None:
        extra = {
            "eval_dataset": partial(data, "test"),
            "eval_step": eval_step,
            "eval_loss": torch.nn.functional.cross_entropy,
        }
    return Trainer.run(
        model_factory,
        optim_factory,
        step,
        cfg,
        dataset=partial(data, "train", 768),
        job_dir=tmp_path / "job",
        **extra,
    )


def _summary(handle) -> dict:
    return json.loads((handle.job_dir / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_a_train_step_exception_fails_the_job_with_its_cause(tmp_path, mode):
    """Was: each rank in turn "lost", regroups, gloo "Connection closed by peer", then "every
    rank was lost"."""
    handle = _run(tmp_path, buggy_step, mode=mode)
    t0 = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        handle.join(timeout=120)
    elapsed = time.monotonic() - t0
    message = str(failed.value)
    where = r"\(at tests/integration/test_user_errors\.py:\d+ in buggy_step\)"
    pattern = rf"^rank [01] failed: ValueError: logits and targets disagree: .* {where}$"
    assert re.match(pattern, message), message
    summary = _summary(handle)
    assert summary["status"] == "failed" and summary["error"] == message
    assert summary["lost_ranks"] == []
    assert "lost" not in message and elapsed < 60
    logs = "".join((handle.job_dir / f"rank_{r}.log").read_text() for r in (0, 1))
    assert "waiting to regroup" not in logs and "Connection closed" not in logs


def test_an_eval_step_exception_fails_the_job(tmp_path):
    """Was: "lost rank 0 while stopping", metrics empty, status ok."""
    handle = _run(tmp_path, classification_step, epochs=1, eval_step=buggy_eval_step)
    with pytest.raises(
        RunFailed,
        match=r"^rank \d failed: KeyError: 0 \(at tests/integration/"
        r"test_user_errors\.py:\d+ in buggy_eval_step\)$",
    ):
        handle.join(timeout=120)
    assert _summary(handle)["status"] == "failed"


def test_on_rank_error_drop_loses_only_the_failing_rank(tmp_path):
    handle = _run(tmp_path, rank1_bug, on_rank_error="drop")
    handle.join(timeout=120)
    summary = _summary(handle)
    assert summary["status"] == "ok" and summary["lost_ranks"] == [1]
    assert handle.result.coverage_exact
    assert "ValueError: rank 1's own bad batch" in (handle.job_dir / "rank_1.log").read_text()


def failing_metrics_fn(metrics) -> None:
    raise RuntimeError("my callback broke")


def test_a_callback_exception_fails_the_job(tmp_path):
    """metrics_fn runs on the launcher: its exception fails the job, status failed."""
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(2)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        builder.build_config(),
        dataset=partial(data, "train", 768),
        metrics_fn=failing_metrics_fn,
        job_dir=tmp_path / "job",
    )
    with pytest.raises(RuntimeError, match="my callback broke"):
        handle.join(timeout=120)
    summary = _summary(handle)
    assert summary["status"] == "failed" and "my callback broke" in summary["error"]


class CorruptSample(torch.utils.data.Dataset):
    """A user's dataset whose sample 700 cannot be read (on whichever rank draws it)."""

    def __init__(self) -> None:
        self.x, self.y = data("train", 768).tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if i == 700:
            raise ValueError("sample 700: truncated record")
        return self.x[i], self.y[i]


def corrupt_dataset() -> CorruptSample:
    return CorruptSample()


def test_a_dataset_exception_fails_the_job(tmp_path):
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(1)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        builder.build_config(),
        dataset=corrupt_dataset,
        job_dir=tmp_path / "job",
    )
    with pytest.raises(RunFailed) as failed:
        handle.join(timeout=120)
    message = str(failed.value)
    assert re.match(
        r"^rank [01] failed: ValueError: .*sample 700.*"
        r"\(at tests/integration/test_user_errors\.py:\d+ in __getitem__\)$",
        message,
    ), message
    assert _summary(handle)["status"] == "failed" and _summary(handle)["lost_ranks"] == []
