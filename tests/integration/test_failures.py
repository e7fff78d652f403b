"""Bad factories fail fast, once, with the rank's own message, and leave no process behind."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flodl.recipes.models import MLP
from flodl.runtime.controller.controller import RunFailed

from .helpers import CLASSES, SHAPE, small_run

pytestmark = pytest.mark.slow


def exploding_factory(device):
    import os

    if os.environ.get("FLODL_RANK") == "1":
        try:  # what Hydra's instantiate does: wrap the user's error with a cut message
            raise FileNotFoundError("pretrained/backbone.pt: no such file")
        except FileNotFoundError as exc:
            raise RuntimeError("Error in call to target 'flodl.recipes.models.MLP':") from exc
    return MLP(SHAPE, CLASSES, hidden=32).to(device)


def uneven_factory(device):
    import os

    hidden = 32 if os.environ.get("FLODL_RANK") == "0" else 48
    return MLP(SHAPE, CLASSES, hidden=hidden).to(device)


def test_factory_error_is_reported_with_its_root_cause_once(tmp_path, capfd):
    """The innermost cause, once, in RunFailed, the console and summary.json; the traceback in
    rank_1.log only; the rank that did not fail exits quietly (no 'control channel lost')."""
    cause = "FileNotFoundError: pretrained/backbone.pt: no such file"
    with pytest.raises(RunFailed, match=f"^rank 1 failed: {cause}$"):
        small_run(tmp_path, "nccl_cadence", model=exploding_factory)
    job = tmp_path / "nccl_cadence"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"rank 1 failed: {cause}"
    console = capfd.readouterr()
    assert "control channel lost" not in console.out + console.err
    assert "ERROR" not in (job / "rank_0.log").read_text()
    assert "Traceback" in (job / "rank_1.log").read_text()
    assert "Error in call to target" in (job / "rank_1.log").read_text()


def test_different_architectures_are_refused(tmp_path):
    with pytest.raises(RunFailed, match="different model architectures"):
        small_run(tmp_path, "nccl_cadence", model=uneven_factory)


def test_in_process_factory_error_surfaces(tmp_path):
    """Refused by the launcher's dry build, before the in-process rank (or any rank) runs."""
    from flodl.config import ConfigError

    def broken(device: torch.device):
        raise RuntimeError("no model for you")

    with pytest.raises(ConfigError, match="broken refused on a dry build: RuntimeError: no model"):
        small_run(tmp_path, "solo", ranks=1, model=broken)


def test_empty_dataset_fails_with_a_clear_message(tmp_path):
    from torch.utils.data import TensorDataset

    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import classification_step

    from .helpers import model_factory, optim_factory

    empty = TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(empty)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, warmup_steps=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path)
        .run()
    )
    with pytest.raises(RunFailed, match="dataset is empty"):
        handle.join(timeout=120)


def test_batch_larger_than_dataset_is_refused(tmp_path):
    from functools import partial

    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import classification_step

    from .helpers import data, model_factory, optim_factory

    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 64))
        .batch_size(65)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, warmup_steps=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path)
        .run()
    )
    with pytest.raises(RunFailed, match=r"trainer\.batch_size=65: larger than the dataset"):
        handle.join(timeout=120)


def nan_step(model, batch):
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return loss * float("nan")


def test_nan_loss_is_skipped_then_stops_the_run(tmp_path):
    from functools import partial

    from flodl import ClusterConfig, LoggerConfig, Trainer

    from .helpers import data, model_factory, optim_factory

    builder = (
        Trainer.builder(model_factory, optim_factory, nan_step)
        .dataset(partial(data, "train", 256))
        .batch_size(32)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, warmup_steps=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
    )
    cfg = builder.build_config().with_(max_nonfinite=3)
    from flodl import Trainer as T

    handle = T.run(
        model_factory,
        optim_factory,
        nan_step,
        cfg,
        dataset=partial(data, "train", 256),
        job_dir=tmp_path,
    )
    with pytest.raises(
        RunFailed, match=r"loss was NaN/inf 4 times \(trainer.max_nonfinite=3\)"
    ) as failed:
        handle.join(timeout=120)
    # The rank that ran out of skips logged each of them (the other may be stopped before its
    # own third: which rank gets there first is a race).
    rank = re.search(r"on rank (\d+)", str(failed.value))
    assert rank is not None, str(failed.value)
    log = (tmp_path / f"rank_{rank.group(1)}.log").read_text()
    assert log.count("non-finite loss") >= 3, log


def test_launcher_never_initialises_cuda(tmp_path, monkeypatch):
    """The launcher must not create a CUDA context before ranks exist
    (docs/design/process-model.md): any path
    into CUDA initialisation in this process is recorded and fails the test."""
    from .helpers import small_run

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: calls.append("_lazy_init"))
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    small_run(tmp_path, "nccl_cadence", epochs=1, n_train=256)
    assert calls == []
    assert not torch.cuda.is_initialized()
