"""Models of the ddp-bench table (docs/design/ddp-bench.md): logistic, MLP, LeNet-5, conv AE,
ResNet-20.

Every model takes ``input_shape`` (the per-sample shape, e.g. ``[1, 28, 28]``) and
``num_classes`` first, so that one config line (``${dataset.input_shape}``) fits any dataset.
Plain ``nn.Module``s: construction is deterministic under ``torch.manual_seed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP", "ConvAE", "LeNet5", "Logistic", "ResNet20"]


def _shape(input_shape: Sequence[int], ndim: int | None = None, *, model: str) -> tuple[int, ...]:
    """Normalise ``input_shape`` (list, tuple or ``ListConfig``) and check it is usable."""
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"{model}: input_shape={list(shape)}: every dimension must be >= 1")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(
            f"{model}: input_shape={list(shape)}: expected {ndim} dims (channels, height, width)"
        )
    return shape


def _classes(num_classes: int, *, model: str) -> int:
    if int(num_classes) < 1:
        raise ValueError(f"{model}: num_classes={num_classes}: must be >= 1")
    return int(num_classes)


class Logistic(nn.Module):
    """Multinomial logistic regression: flatten, then one ``Linear(prod(shape) -> classes)``."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        features = math.prod(_shape(input_shape, model="Logistic"))
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(features, _classes(num_classes, model="Logistic"))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MLP(nn.Module):
    """One hidden layer: flatten, ``Linear -> ReLU -> Linear`` (784 -> 256 -> 10 on MNIST)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        features = math.prod(_shape(input_shape, model="MLP"))
        if int(hidden) < 1:
            raise ValueError(f"MLP: hidden={hidden}: must be >= 1")
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, int(hidden)),
            nn.ReLU(),
            nn.Linear(int(hidden), _classes(num_classes, model="MLP")),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet5(nn.Module):
    """LeNet-5 (LeCun 1998), modern variant: BatchNorm + ReLU in the conv stages, max pooling.

    conv 6@5x5 (pad 2) -> BN -> ReLU -> pool, conv 16@5x5 -> BN -> ReLU -> pool,
    FC 120 -> ReLU -> FC 84 -> ReLU -> FC classes. The fully connected layers carry no
    BatchNorm: a rank can receive a one-sample tail batch, on which ``BatchNorm1d`` fails.
    On maps too small for the unpadded second conv (8x8 scikit-learn digits) it is padded
    too, so the same class serves 28x28 MNIST (16*5*5 features) and 8x8 digits (16*2*2).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _shape(input_shape, 3, model="LeNet5")
        # after conv1 (size-preserving) and the first 2x2 pool
        h1, w1 = height // 2, width // 2
        pad2 = 0 if min(h1, w1) >= 6 else 2
        h2, w2 = (h1 + 2 * pad2 - 4) // 2, (w1 + 2 * pad2 - 4) // 2
        if min(h1, w1, h2, w2) < 1:
            raise ValueError(
                f"LeNet5: input_shape={[channels, height, width]}: height and width must be >= 4"
            )
        self.features = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=2),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=pad2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * h2 * w2, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, _classes(num_classes, model="LeNet5")),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ConvAE(nn.Module):
    """Convolutional autoencoder: 2 strided convs down, 2 transposed convs up, sigmoid out.

    (C, H, W) -> (16, H/2, W/2) -> (32, H/4, W/4) -> (16, H/2, W/2) -> (C, H, W); height and
    width must be divisible by 4. ``num_classes`` is accepted for a uniform factory signature
    and ignored. The sigmoid bounds outputs to [0, 1]: inputs normalised beyond that range
    (mean/std) cannot be matched exactly, which only raises the floor of the MSE.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int = 0) -> None:
        super().__init__()
        channels, height, width = _shape(input_shape, 3, model="ConvAE")
        if height % 4 or width % 4:
            raise ValueError(
                f"ConvAE: input_shape={[channels, height, width]}: "
                "height and width must be divisible by 4"
            )
        self.encoder = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(32, 16, kernel_size=3, stride=2, padding=1, output_padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(16, channels, kernel_size=3, stride=2, padding=1, output_padding=1),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN plus shortcut, then ReLU.

    The shortcut is the identity, or a 1x1 strided conv + BN where the shape changes
    (He et al. option B, as in the ddp-bench ResNet-20).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2015, §4.2): 3x3 conv, 3 stages of 3 basic blocks, GAP, FC.

    Stages have 16/32/64 channels; stages 2 and 3 halve the resolution; about 0.27M
    parameters. ``blocks`` per stage gives ResNet-(6 * blocks + 2): 3 is ResNet-20, 5 is
    ResNet-32. Built for 3x32x32 CIFAR images; global average pooling lets it run on any
    input of at least 4x4 pixels.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, blocks: int = 3) -> None:
        super().__init__()
        channels, height, width = _shape(input_shape, 3, model="ResNet20")
        if min(height, width) < 4:
            raise ValueError(
                f"ResNet20: input_shape={[channels, height, width]}: height and width must be >= 4"
            )
        if int(blocks) < 1:
            raise ValueError(f"ResNet20: blocks={blocks}: must be >= 1")
        self.stem = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        stages: list[nn.Module] = []
        in_ch = 16
        for out_ch, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(int(blocks)):
                stages.append(BasicBlock(in_ch, out_ch, stride if i == 0 else 1))
                in_ch = out_ch
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, _classes(num_classes, model="ResNet20"))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # He init, as in the paper; PyTorch's default is tuned for linear layers
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(x, 1))
