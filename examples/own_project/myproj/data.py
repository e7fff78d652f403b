"""The project's dataset: a map-style torch Dataset per split (``dataset._target_``)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def blobs(
    split: str = "train", n: int = 512, features: int = 16, num_classes: int = 4, seed: int = 0
) -> TensorDataset:
    """Gaussian blobs around one centre per class (the same centres in every split)."""
    centres = torch.randn(num_classes, features, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + (1 if split == "train" else 2))
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = centres[y] * 2.0 + torch.randn(n, features, generator=g)
    return TensorDataset(x, y)
