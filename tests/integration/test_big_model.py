"""A model past the old 256 MiB frame bound (72 M parameters, 288 MB; with SGD momentum each
bundle is ~0.9 GB): it trains on the 2-rank rig in a collective mode, checkpoints every epoch,
resumes in a cpu_* mode, and each run's model.pt is the state that was evaluated.

The parameters sit in an embedding table (an LM-sized vocabulary) so that a step costs little
compute: the test is about moving and saving the bytes, and must stay short on 2 busy cores."""

from __future__ import annotations

import gc
import json
from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, TrainedState, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.recipes.models import MLP
from flodl.recipes.steps import accuracy, classification_step

from .helpers import CLASSES, SHAPE, data

pytestmark = pytest.mark.slow

ROWS = 1_125_000  # x 64 = 72 M parameters


class TableNet(torch.nn.Module):
    """A small MLP plus an embedding table looked up by hashed input values."""

    def __init__(self) -> None:
        super().__init__()
        self.head = MLP(SHAPE, CLASSES, hidden=32)
        self.table = torch.nn.Embedding(ROWS, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x.flatten(1)[:, :8].abs() * 1e4).long() % ROWS
        return self.head(x) + 0.01 * self.table(rows).sum(1)[:, :CLASSES]


def big_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return TableNet().to(device)


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _run(tmp_path, name, mode, epochs, **trainer):
    cfg = (
        Trainer.builder(big_model, sgd, classification_step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode=mode, anchor=2))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 1.0], warmup_steps=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    handle = Trainer.run(
        big_model,
        sgd,
        classification_step,
        cfg,
        dataset=partial(data, "train", 256),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        job_dir=tmp_path / name,
    )
    handle.join(timeout=150)
    return handle.result


def _evaluate(state: TrainedState) -> float:
    """The eval metric of ``state`` over the whole eval set, as the ranks compute it."""
    model = state.load_into(big_model(torch.device("cpu"))).eval()
    inputs, target = data("test")[:]
    with torch.no_grad():
        return float(accuracy(model, inputs, target))


def _check(result, job_dir, stem, epoch):
    assert result.summary.status == "ok", result.summary.error
    written = TrainedState.load(job_dir / "model.pt")
    payload, meta = load_bundle(stem)
    assert (meta.epoch, meta.save_reason, meta.world_size) == (epoch, "final", 2)
    assert sorted(payload["optimizer"]) == [0, 1]
    for key, value in result.state.params.items():
        assert torch.equal(written.params[key], value), key
        assert torch.equal(payload["params"][key], value), key
    del payload
    gc.collect()
    assert _evaluate(written) == pytest.approx(result.summary.eval_value, abs=1e-6)


def test_72m_parameters_checkpoint_and_resume_across_modes(tmp_path):
    stem = str(tmp_path / "ckpt" / "run")
    first = _run(tmp_path, "first", "nccl_cadence", 2, save_path=stem, checkpoint_every=1)
    assert sum(v.numel() for v in first.state.params.values()) > 70_000_000
    _check(first, tmp_path / "first", stem, 2)
    meta = json.loads((tmp_path / "ckpt" / "run.meta.json").read_text())
    assert max(s["bytes"] for s in meta["shards"].values()) > 256 << 20  # past the old bound
    del first
    gc.collect()
    resumed = _run(tmp_path, "resumed", "cpu_cadence", 3, resume_from=stem, save_path=stem)
    assert [m.epoch for m in resumed.epochs] == [3]  # epochs count from 1: the third
    _check(resumed, tmp_path / "resumed", stem, 3)
