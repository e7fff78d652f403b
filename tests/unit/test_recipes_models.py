"""flodl.recipes.models and the model/optimizer config groups: shapes, sizes, gradients, configs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from flodl.recipes import models
from flodl.recipes.datasets import mnist5k

CONF = Path(__file__).resolve().parents[2] / "conf"
MNIST_SHAPE = (1, 28, 28)

# (class, input shape, output shape of a batch of 3, exact parameter count)
CASES = [
    (models.Logistic, MNIST_SHAPE, (3, 10), 784 * 10 + 10),
    (models.MLP, MNIST_SHAPE, (3, 10), 784 * 256 + 256 + 256 * 10 + 10),
    (models.LeNet5, MNIST_SHAPE, (3, 10), 61_750),
    (models.LeNet5, (1, 8, 8), (3, 10), 21_430),
    (models.ConvAE, MNIST_SHAPE, (3, 1, 28, 28), 9_569),
    (models.ResNet20, (3, 32, 32), (3, 10), 272_474),
]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("cls", "shape", "out", "params"), CASES)
def test_forward_shape_and_size(cls, shape, out, params) -> None:
    torch.manual_seed(0)
    model = cls(list(shape), 10)
    assert model(torch.randn(3, *shape)).shape == out
    assert n_params(model) == params


def test_resnet20_is_the_027m_parameter_network() -> None:
    model = models.ResNet20([3, 32, 32], 10)
    assert 0.26e6 < n_params(model) < 0.28e6
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 19  # + the FC layer = 20 weighted layers; 1x1 shortcuts not counted
    # global average pooling: any image size works, logits stay [B, classes]
    assert model(torch.randn(2, 3, 20, 24)).shape == (2, 10)


@pytest.mark.parametrize(("cls", "shape", "out", "params"), CASES)
def test_one_backward_reaches_every_parameter(cls, shape, out, params) -> None:
    torch.manual_seed(0)
    model = cls(shape, 10)
    y = model(torch.randn(4, *shape))
    loss = y.square().mean() if y.dim() == 4 else nn.functional.cross_entropy(y, torch.arange(4))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls", [models.Logistic, models.LeNet5, models.ResNet20])
def test_construction_is_deterministic_under_manual_seed(cls) -> None:
    shape = (3, 32, 32) if cls is models.ResNet20 else MNIST_SHAPE
    torch.manual_seed(7)
    a = cls(shape, 10).state_dict()
    torch.manual_seed(7)
    b = cls(shape, 10).state_dict()
    torch.manual_seed(8)
    c = cls(shape, 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_conv_ae_output_is_a_bounded_reconstruction() -> None:
    model = models.ConvAE(MNIST_SHAPE)
    y = model(torch.randn(2, *MNIST_SHAPE) * 10)
    assert ((y >= 0) & (y <= 1)).all()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: models.LeNet5([784], 10), "input_shape"),
        (lambda: models.LeNet5([1, 2, 2], 10), "input_shape"),
        (lambda: models.ConvAE([1, 30, 30]), "divisible by 4"),
        (lambda: models.ResNet20([3, 32], 10), "input_shape"),
        (lambda: models.MLP([1, 28, 28], 10, hidden=0), "hidden"),
        (lambda: models.Logistic([1, 0, 28], 10), "input_shape"),
        (lambda: models.Logistic([1, 28, 28], 0), "num_classes"),
    ],
)
def test_bad_arguments_name_the_argument(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# --- config groups ---------------------------------------------------------------------------


def _model_node(path: Path):
    """The model section of a model config file (conv_ae is a global-package overlay)."""
    cfg = OmegaConf.load(path)
    return cfg.model if "_global_" in path.read_text().splitlines()[0] else cfg


LANGUAGE_MODELS = {"char_rnn", "gpt_nano"}  # built from their configs in test_recipes_lm.py


@pytest.mark.parametrize(
    "path",
    # model=hf builds a Hugging Face model from its own dataset's tokenizer (tests/unit/test_hf.py)
    [
        p
        for p in sorted((CONF / "model").glob("*.yaml"))
        if p.stem not in LANGUAGE_MODELS and p.stem != "hf"
    ],
    ids=lambda p: p.stem,
)
def test_model_config_builds_a_model_for_mnist5k(path: Path) -> None:
    from hydra.utils import instantiate

    cfg = OmegaConf.create({"dataset": OmegaConf.load(CONF / "dataset" / "mnist5k.yaml")})
    cfg.model = _model_node(path)
    OmegaConf.resolve(cfg)
    assert list(cfg.model.input_shape) == [1, 28, 28]
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    x = mnist5k("test").tensors[0][:4]
    y = model(x)
    assert y.shape == ((4, 1, 28, 28) if path.stem == "conv_ae" else (4, 10))


def test_model_configs_cover_the_ddp_bench_table() -> None:
    names = {p.stem for p in (CONF / "model").glob("*.yaml")}
    assert {"logistic", "mlp", "lenet", "conv_ae", "resnet", *LANGUAGE_MODELS} <= names


@pytest.mark.parametrize("path", sorted((CONF / "optimizer").glob("*.yaml")), ids=lambda p: p.stem)
def test_optimizer_config_builds_and_steps(path: Path) -> None:
    from hydra.utils import get_method

    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(cfg, dict)
    target = get_method(cfg.pop("_target_"))
    param = nn.Parameter(torch.ones(3))
    optimizer = target([param], **cfg)  # how the runner builds it
    param.sum().backward()
    optimizer.step()
    assert (param < 1).all()
    assert optimizer.defaults["lr"] == cfg["lr"] > 0


def _compose(tmp_path: Path, overrides: list[str]):
    """Compose the real group files under a minimal primary config that lists task first."""
    from hydra import compose, initialize_config_dir

    for group in ("model", "dataset", "optimizer", "task"):
        shutil.copytree(CONF / group, tmp_path / group)
    (tmp_path / "config.yaml").write_text(
        "defaults:\n  - task: classification\n  - model: mlp\n  - optimizer: adam\n"
        "  - dataset: mnist5k\n  - _self_\n"
    )
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_conv_ae_switches_the_task_to_reconstruction(tmp_path: Path) -> None:
    assert _compose(tmp_path / "a", [])["task"]["eval_metric"] == "accuracy"
    cfg = _compose(tmp_path / "b", ["model=conv_ae"])
    assert cfg.task.train_step == "flodl.recipes.steps.reconstruction_step"
    assert cfg.task.eval_higher_is_better is False
    assert cfg.model._target_ == "flodl.recipes.models.ConvAE"
    assert list(cfg.model.input_shape) == [1, 28, 28]
    # an explicit command-line choice still wins over the model's default task
    cfg = _compose(tmp_path / "c", ["model=conv_ae", "task=classification"])
    assert cfg.task.eval_metric == "accuracy"
