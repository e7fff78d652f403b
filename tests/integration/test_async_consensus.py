"""cpu_async ends every epoch at the ranks' average: what is evaluated, checkpointed and returned
is one set of weights, the consensus, not each rank's local weights halfway to it (EASGD's
blend). Checked against a hand computation of the eval loss on the weights the run hands back."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from flodl import ClusterConfig, ElCheConfig, EpochMetrics, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.config import MonitorConfig
from flodl.recipes.steps import classification_step

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def eval_loss_of(params: dict[str, torch.Tensor]) -> float:
    model = model_factory(torch.device("cpu"))
    model.load_state_dict(params)
    model.eval()
    x, y = data("test").tensors
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


@pytest.mark.parametrize("ranks", [2, 3])
def test_cpu_async_evaluates_checkpoints_and_returns_the_consensus(tmp_path, ranks):
    seen: list[EpochMetrics] = []
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 1536))
        .eval_dataset(partial(data, "test"))
        .eval_loss(F.cross_entropy)
        .eval_policy("sharded")  # every rank evaluates its part on its own weights
        .batch_size(16)
        .num_epochs(2)
        .seed(3)
        .elche(ElCheConfig(mode="cpu_async"))
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=ranks, speeds=[1.0, 0.5, 0.7][:ranks], warmup_steps=2
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(seen.append)
        .output_dir(tmp_path / "job")
        .save_best(MonitorConfig(monitor="eval_loss", mode="min"), save_path=str(tmp_path / "b"))
        .run()
    )
    state = handle.join(timeout=240)
    summary = handle.result.summary
    assert summary.status == "ok"
    assert summary.syncs >= 2 * 2  # windows blended in, not only each epoch's last
    assert [m.epoch for m in seen] == [1, 2]
    # The last epoch's loss, merged from every rank's shard, is the returned weights' loss.
    assert eval_loss_of(state.params) == pytest.approx(seen[-1].eval_metrics["eval_loss"], abs=1e-5)
    # The best bundle holds the weights its loss was computed on, whichever epoch that was.
    payload, meta = load_bundle(str(tmp_path / "b_best"))
    recorded = seen[meta.epoch - 1].eval_metrics["eval_loss"]
    assert eval_loss_of(payload["params"]) == pytest.approx(recorded, abs=1e-5)
    # And the last bundle is the returned state.
    last, _ = load_bundle(str(tmp_path / "b"))
    for name, value in state.params.items():
        assert torch.equal(last["params"][name], value), name
