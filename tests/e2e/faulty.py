"""Components that fail the way users' components do, for the end-to-end failure tests."""

from __future__ import annotations

from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFileSystem
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


class PretrainedBackbone(nn.Module):
    """A model whose constructor needs a file that is not there."""

    def __init__(
        self, input_shape: list[int], num_classes: int, hidden: int = 0, path: str = "pretrained"
    ) -> None:
        super().__init__()
        raise FileNotFoundError(f"{path}/backbone.pt: no such file")


def missing_dataset(split: str = "train", root: str = "pretrained", **_: Any) -> Any:
    """A dataset factory that fails on the ranks (the launcher never builds datasets)."""
    raise FileNotFoundError(f"{root}/backbone.pt: no such file")


class FullDisk(MemoryFileSystem):
    """``fulldisk://``: accepts the launcher's write probe, then refuses every bundle write."""

    protocol = "fulldisk"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and ".write-probe-" not in path:
            raise OSError(28, "No space left on device", path)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("fulldisk", FullDisk, clobber=True)


class StreamOnly(IterableDataset):
    """A plain IterableDataset: refused in the launcher (the controller plans samples)."""

    def __init__(self, split: str = "train", **_: Any) -> None:
        self.split = split

    def __iter__(self) -> Any:
        return iter(())


def wrapped_loader(split: str = "train", **_: Any) -> DataLoader:
    """A dataset factory that builds a DataLoader: refused, naming the loader node."""
    raise AssertionError("never called: refused by its return annotation")
