"""Checkpoints and resume on a real 2-rank rig: equivalence, fsspec URLs, hostile bundles."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import fsspec
import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.config import ConfigError
from flodl.recipes.steps import accuracy, classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def run(tmp_path, name, epochs, ranks=2, model=model_factory, outer="average", **trainer):
    builder = (
        Trainer.builder(model, optim_factory, classification_step)
        .dataset(partial(data, "train", 512))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(epochs)
        .scheduler(step_lr)
        .elche(ElCheConfig(mode="nccl_sync", outer=outer))
        .cluster(
            ClusterConfig(kind="cpu_rig", ranks=ranks, speeds=[1.0, 0.5][:ranks], warmup_steps=2)
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / name)
    )
    cfg = builder.build_config().with_(**trainer)
    handle = Trainer.run(
        model,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", 512),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        scheduler_factory=step_lr,
        job_dir=tmp_path / name,
    )
    return handle, handle.join(timeout=240)


@pytest.fixture(scope="module")
def first_bundle(tmp_path_factory) -> str:
    """One 1-epoch run (outer average) with a save, shared: the bundle the average-outer resume
    continues from, which the refusal tests load for another model or damage (in a copy)."""
    root = tmp_path_factory.mktemp("first_bundle")
    stem = str(root / "ckpt" / "run")
    run(root, "first", 1, save_path=stem)
    return stem


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_stop_after_epoch_k_and_resume_equals_uninterrupted(tmp_path, request, outer):
    _, straight = run(tmp_path, "straight", 3, outer=outer)
    if outer == "average":
        stem = request.getfixturevalue("first_bundle")
    else:
        stem = str(tmp_path / "ckpt" / "run")
        run(tmp_path, "first", 1, outer=outer, save_path=stem)
    payload, meta = load_bundle(stem)
    assert (meta.epoch, meta.world_size, meta.save_reason) == (1, 2, "final")
    assert meta.coverage["uncovered"] == [] and meta.elche_state is not None
    assert (payload["outer"] is not None) == (outer == "nesterov")  # the outer momentum
    resumed, state = run(tmp_path, "resumed", 3, outer=outer, resume_from=stem)
    assert [m.epoch for m in resumed.result.epochs] == [2, 3]  # the 2nd and 3rd epochs
    # the summary counts as the console and the bundle do (was: 2, this run's epochs only)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["epochs"] == 3 == resumed.result.summary.epochs
    for key, value in straight.params.items():
        assert torch.allclose(state.params[key], value, atol=1e-5), key
    # the scheduler continued where it stopped: 1e-2 x2 (two ranks) x0.7 per epoch
    assert resumed.result.epochs[-1].lr == pytest.approx(2e-2 * 0.7**2)


def test_checkpoint_every_on_a_memory_url(tmp_path):
    stem = "memory://flodl-tests/every/run"
    _handle, _ = run(tmp_path, "every", 3, save_path=stem, checkpoint_every=1)
    payload, meta = load_bundle(stem)
    assert meta.save_reason == "final" and meta.epoch == 3
    assert set(payload["optimizer"]) == {0, 1}  # every rank's optimizer state
    assert meta.global_step == 3 * 512 // 32
    fsspec.filesystem("memory").rm("/flodl-tests", recursive=True)


def test_corrupt_bundle_is_refused_and_kept(tmp_path, first_bundle):
    shutil.copytree(Path(first_bundle).parent, tmp_path / "bad")  # the shared one stays whole
    stem = str(tmp_path / "bad" / "run")
    pt = next((tmp_path / "bad").glob("run.*.model.pt"))  # the weights shard
    blob = pt.read_bytes()
    pt.write_bytes(blob[: len(blob) // 2])  # truncated
    with pytest.raises(ConfigError, match=r"model\.pt is corrupt or truncated"):
        run(tmp_path, "resumed", 2, resume_from=stem)
    assert pt.read_bytes() == blob[: len(blob) // 2]  # nothing touched what was there


def test_bundle_for_another_model_is_refused(tmp_path, first_bundle):
    stem = first_bundle

    def wider(device):
        from flodl.recipes.models import MLP

        return MLP([1, 8, 8], 4, hidden=48).to(device)

    from flodl.config import ConfigError

    # The launcher's dry build of the closures knows the architecture: refused before any rank.
    with pytest.raises(ConfigError, match="saved for another model"):
        run(tmp_path, "wider", 2, model=wider, resume_from=stem)
    assert not list((tmp_path / "wider").glob("rank_*.log"))
