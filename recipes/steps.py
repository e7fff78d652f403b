"""Train steps ``fn(model, batch) -> loss``, eval steps ``fn(model, batch) -> (preds, target)``
and legacy eval functions ``fn(model, input, target) -> float``.

The runner owns the loop, the optimizer, devices and averaging; a step only turns one batch into
a scalar loss (and may ``record_scalar`` side metrics). Evaluation is best expressed as
torchmetrics metrics (``task.metrics``) fed by an eval step; a legacy eval function is called
once per eval chunk and must return that chunk's *mean over samples* (the runner weights chunks
by size), so sums, counts, F1 or AUC belong in ``task.metrics`` instead.
``conf/task/*.yaml`` names what a run uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from flodl.monitor.metrics import record_scalar

__all__ = [
    "accuracy",
    "augmented_classification_step",
    "bits_per_char",
    "classification_step",
    "language_model_step",
    "reconstruction_mse",
    "reconstruction_outputs",
    "reconstruction_step",
    "val_loss",
]

EVAL_CHUNK = 1024  # eval inputs are split so a 10k-image test set does not need 10k activations


def classification_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(input)`` against class labels; records training ``accuracy``."""
    inputs, target = batch[0], batch[1]
    logits = model(inputs)
    with torch.no_grad():
        record_scalar("accuracy", (logits.argmax(dim=1) == target).float().mean().item())
    return F.cross_entropy(logits, target)


def augmented_classification_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`classification_step` on a randomly shifted and mirrored batch (CIFAR recipe).

    Zero-pads 4 pixels, crops back at a random offset and flips horizontally with p=0.5, one
    draw per batch as in the ddp-bench ResNet-20 (zero is the mean after normalisation).
    """
    inputs = batch[0]
    height, width = inputs.shape[-2:]
    padded = F.pad(inputs, (4, 4, 4, 4))
    dy, dx, flip = (int(v) for v in torch.randint(0, 9, (3,)))
    inputs = padded[..., dy : dy + height, dx : dx + width]
    if flip % 2:
        inputs = inputs.flip(-1)
    return classification_step(model, (inputs, batch[1]))


def reconstruction_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean squared error between ``model(input)`` and ``input``; labels, if any, are ignored."""
    inputs = batch[0]
    return F.mse_loss(model(inputs), inputs)


def reconstruction_outputs(
    model: nn.Module, batch: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval step of autoencoders: ``(model(input), input)`` for the metrics to compare."""
    return model(batch[0]), batch[0]


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (BatchNorm running stats, no dropout) and no grad, restoring the mode after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _chunked_mean(
    model: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor,
    per_sample_sum: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> float:
    """Mean over samples of a per-chunk sum, evaluated ``EVAL_CHUNK`` samples at a time."""
    if len(inputs) == 0:
        raise ValueError("eval set is empty: cannot average over zero samples")
    total = 0.0
    with _evaluating(model):
        for start in range(0, len(inputs), EVAL_CHUNK):
            x = inputs[start : start + EVAL_CHUNK]
            y = target[start : start + EVAL_CHUNK]
            total += float(per_sample_sum(model(x), x, y))
    return total / len(inputs)


def accuracy(model: nn.Module, input: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of samples whose arg-max class equals ``target`` (higher is better)."""
    return _chunked_mean(model, input, target, lambda out, _x, y: (out.argmax(dim=1) == y).sum())


def reconstruction_mse(model: nn.Module, input: torch.Tensor, target: torch.Tensor) -> float:
    """Mean squared reconstruction error of ``input`` (``target`` is ignored; lower is better)."""
    return _chunked_mean(
        model,
        input,
        target,
        lambda out, x, _y: F.mse_loss(out, x, reduction="sum") / x[0].numel(),
    )


def _token_ce(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction
    )


def language_model_step(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Next-character cross-entropy (nats/char), averaged over every position of the batch;
    records training ``bits_per_char``."""
    inputs, target = batch[0], batch[1]
    loss = _token_ce(model(inputs), target, "mean")
    record_scalar("bits_per_char", loss.item() / math.log(2))
    return loss


def val_loss(model: nn.Module, input: torch.Tensor, target: torch.Tensor) -> float:
    """Mean next-character cross-entropy in nats/char over ``input``'s windows (lower is better).

    A mean over samples: every window holds ``block_size`` positions, so the runner's
    sample-weighted mean over eval batches is the mean over all tokens of the eval set.
    """
    return _chunked_mean(
        model,
        input,
        target,
        lambda out, _x, y: _token_ce(out, y, "sum") / y[0].numel(),
    )


def bits_per_char(model: nn.Module, input: torch.Tensor, target: torch.Tensor) -> float:
    """:func:`val_loss` in bits: nats / ln 2."""
    return val_loss(model, input, target) / math.log(2)
