"""Nothing trained is lost: a save that fails mid-run stops the run cleanly, and the trained
state still reaches model.pt in the job directory (the error says so)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

import tests.e2e.faulty  # noqa: F401  (registers fulldisk://)
from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer, TrainerConfig
from flodl.recipes.models import MLP
from flodl.recipes.steps import classification_step
from flodl.runtime.controller.controller import RunFailed
from flodl.trainer import TrainedState

from .helpers import CLASSES, SHAPE, data, model_factory, optim_factory


def _failing_run(job, n: int, **trainer) -> tuple[TrainerConfig, dict]:
    """A solo in-process run saving to ``fulldisk://`` (every bundle write refused); the
    config and the summary it wrote, once the run failed on that."""
    config = TrainerConfig(
        batch_size=64,
        elche=ElCheConfig(mode="solo"),
        cluster=ClusterConfig(kind="auto"),
        logger=LoggerConfig(progress="off", tensorboard=False),
        device="cpu",
        **trainer,
    )
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .config(config)
        .dataset(partial(data, "train", n))
        .output_dir(job)
        .run()
    )
    with pytest.raises(RunFailed, match="No space left on device"):
        handle.join(timeout=120)
    return config, json.loads((job / "summary.json").read_text())


@pytest.mark.light  # in-process: no rank process
def test_a_failed_save_stops_cleanly_and_keeps_the_trained_state(tmp_path, capfd):
    job = tmp_path / "job"
    config, summary = _failing_run(
        job, 512, num_epochs=4, save_path="fulldisk://ckpt/run", checkpoint_every=1
    )
    assert summary["status"] == "failed"
    assert "saving a checkpoint to fulldisk://ckpt/run failed: OSError" in summary["error"]
    assert str(job / "model.pt") in summary["error"]
    assert 1 <= summary["epochs"] < 4  # stopped at the first failed save, not at the end
    trained = TrainedState.load(job / "model.pt").load_into(MLP(SHAPE, CLASSES, hidden=32))
    torch.manual_seed(config.seed)
    fresh = MLP(SHAPE, CLASSES, hidden=32)
    assert any(
        not torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters(), strict=True)
    )  # what was trained, not the initial weights
    assert f"flodl: outputs in {job}" in capfd.readouterr().err  # the API says where


@pytest.mark.light  # in-process: no rank process
def test_a_failed_end_of_run_save_trains_every_epoch_and_says_which_save(tmp_path, caplog):
    """No periodic checkpoints: only the end-of-run save fails. Every epoch trained, the run
    reports the failed save (not 'stopping': nothing was left to stop), model.pt is written."""
    job = tmp_path / "job"
    _, summary = _failing_run(job, 256, num_epochs=2, save_path="fulldisk://ckpt/final")
    assert summary["status"] == "failed" and summary["epochs"] == 2
    assert "saving a checkpoint to fulldisk://ckpt/final failed: OSError" in summary["error"]
    logged = [r.getMessage() for r in caplog.records if "fulldisk://ckpt/final" in r.getMessage()]
    assert logged and all("stopping" not in m for m in logged), logged
    assert any("the end-of-run save" in m for m in logged), logged
    assert (job / "model.pt").exists()
