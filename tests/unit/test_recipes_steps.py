"""flodl.recipes.steps and the task config group: losses, recorded scalars, eval functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from flodl.config import schema_node
from flodl.monitor.metrics import drain_scalars
from flodl.recipes import steps
from flodl.recipes.datasets import mnist5k
from flodl.recipes.models import ConvAE

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(autouse=True)
def _no_leftover_scalars():
    drain_scalars()
    yield
    drain_scalars()


def _one_hot_model() -> nn.Module:
    """Logits equal the input: the predicted class is the arg-max input feature."""
    return nn.Identity()


def test_classification_step_is_cross_entropy_and_records_accuracy() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    loss = steps.classification_step(model, (x, y))
    assert loss.requires_grad and loss.dim() == 0
    assert loss.item() == pytest.approx(F.cross_entropy(model(x), y).item())
    expected_acc = (model(x).argmax(1) == y).float().mean().item()
    assert drain_scalars() == {"accuracy": (pytest.approx(expected_acc), 1.0)}
    loss.backward()
    assert model.weight.grad is not None


def test_augmented_step_shifts_or_flips_but_keeps_shape() -> None:
    seen = []

    class Recorder(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return x.flatten(1)[:, :10]

    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8) + 1
    torch.manual_seed(0)
    for _ in range(10):
        steps.augmented_classification_step(Recorder(), (x, torch.tensor([0, 1])))
    assert all(s.shape == x.shape for s in seen)
    assert any(not torch.equal(s, x) for s in seen)
    # every view is x shifted by at most 4 pixels (zeros entering) or mirrored: values survive
    for s in seen:
        kept = s[s != 0]
        assert torch.isin(kept, x).all() and len(kept) >= 2 * 3 * 4 * 4


def test_reconstruction_step_is_mse_against_the_input() -> None:
    torch.manual_seed(0)
    model = nn.Conv2d(1, 1, 3, padding=1)
    x = torch.randn(4, 1, 6, 6)
    loss = steps.reconstruction_step(model, (x, torch.zeros(4, dtype=torch.long)))
    assert loss.item() == pytest.approx(F.mse_loss(model(x), x).item())
    assert steps.reconstruction_step(nn.Identity(), (x,)).item() == 0


def test_accuracy_counts_correct_argmax() -> None:
    x = torch.eye(4)  # sample i predicts class i
    target = torch.tensor([0, 1, 2, 0])
    assert steps.accuracy(_one_hot_model(), x, target) == pytest.approx(0.75)


def test_eval_functions_chunk_without_changing_the_result(monkeypatch) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(10, 4), torch.randint(0, 4, (10,))
    model = nn.Linear(4, 4)
    whole_acc = steps.accuracy(model, x, y)
    whole_mse = steps.reconstruction_mse(model, x, y)
    monkeypatch.setattr(steps, "EVAL_CHUNK", 3)
    assert steps.accuracy(model, x, y) == pytest.approx(whole_acc)
    assert steps.reconstruction_mse(model, x, y) == pytest.approx(whole_mse)
    assert whole_mse == pytest.approx(F.mse_loss(model(x), x).item())


def test_eval_uses_running_stats_and_restores_training_mode() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3))
    model.train()
    before = model[0].running_mean.clone()
    steps.accuracy(model, torch.randn(16, 3) + 5, torch.zeros(16, dtype=torch.long))
    assert model.training
    assert torch.equal(model[0].running_mean, before)  # eval never updates BN statistics


def test_eval_of_an_empty_set_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        steps.accuracy(_one_hot_model(), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))


def test_reconstruction_step_trains_the_autoencoder_on_mnist5k() -> None:
    torch.manual_seed(0)
    x, y = mnist5k("train", test_size=4800).tensors  # 200 images are plenty for a trend
    model = ConvAE([1, 28, 28])
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    start = steps.reconstruction_mse(model, x, y)
    for step in range(40):
        batch = (x[(step * 32) % 200 :][:32], y[:32])
        loss = steps.reconstruction_step(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert steps.reconstruction_mse(model, x, y) < 0.8 * start


# --- config group ----------------------------------------------------------------------------

TASK_KEYS = {
    "train_step",
    "eval_fn",
    "eval_step",
    "eval_loss",
    "metrics",
    "eval_metric",
    "eval_higher_is_better",
    "metrics_fn",
    "eval_result_fn",
    "epoch_fn",
    "objective",
    "objective_direction",
}


@pytest.mark.parametrize("path", sorted((CONF / "task").glob("*.yaml")), ids=lambda p: p.stem)
def test_task_config_points_at_real_functions(path: Path) -> None:
    from hydra.utils import get_method

    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(cfg, dict) and cfg.pop("defaults") == ["_schema", "_self_"]
    cfg = {**schema_node("task"), **cfg}  # as Hydra composes it
    assert set(cfg) == TASK_KEYS
    paths = [cfg[k] for k in ("train_step", "eval_fn", "eval_step", "eval_loss") if cfg[k]]
    assert all(callable(get_method(p)) for p in paths) and len(paths) >= 2
    assert all(callable(get_method(m["_target_"])) for m in cfg["metrics"].values())
    # the reported metric is a task metric, or the legacy eval_fn's value under that name
    assert cfg["eval_metric"] in cfg["metrics"] or cfg["eval_fn"]
    assert isinstance(cfg["eval_higher_is_better"], bool)


def test_task_directions_match_their_metrics() -> None:
    classification = OmegaConf.load(CONF / "task" / "classification.yaml")
    reconstruction = OmegaConf.load(CONF / "task" / "reconstruction.yaml")
    assert (classification.eval_metric, classification.eval_higher_is_better) == ("accuracy", True)
    assert (reconstruction.eval_metric, reconstruction.eval_higher_is_better) == ("mse", False)
