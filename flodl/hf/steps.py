"""``task=causal_lm`` and ``task=seq_classification``: train and eval steps over dict batches
that use the model's own loss (transformers computes it from ``labels``).

Eval steps return ``(preds, target)`` for torchmetrics: next-token logits and the tokens they
predict (``Perplexity``; ``eval_loss`` is their mean cross-entropy, so perplexity is
``exp(eval_loss)``), or class logits and labels (``MulticlassAccuracy``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from flodl.monitor.metrics import record_scalar

__all__ = [
    "causal_lm_outputs",
    "causal_lm_step",
    "classification_outputs",
    "seq_classification_step",
    "token_cross_entropy",
]


def causal_lm_step(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's own next-token loss (``labels`` = the inputs; the model shifts them);
    records training ``perplexity``."""
    ids = batch["input_ids"]
    out = model(input_ids=ids, attention_mask=batch.get("attention_mask"), labels=ids)
    record_scalar("perplexity", math.exp(min(out.loss.item(), 50.0)))
    return out.loss


def causal_lm_outputs(
    model: nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval step: logits at positions ``0..T-2`` (float32) and the tokens ``1..T-1``."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch.get("attention_mask")).logits
    return logits[:, :-1].float(), ids[:, 1:]


def token_cross_entropy(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every predicted token (nats/token): the eval loss."""
    return F.cross_entropy(preds.reshape(-1, preds.shape[-1]), target.reshape(-1))


def seq_classification_step(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's own classification loss over ``labels``; records training ``accuracy``."""
    if "labels" not in batch:
        raise ValueError(
            "task=seq_classification: the batches have no labels; set dataset.label_column "
            f"(the samples hold {', '.join(batch)})"
        )
    out = model(**batch)
    with torch.no_grad():
        hits = (out.logits.argmax(dim=-1) == batch["labels"]).float().mean().item()
    record_scalar("accuracy", hits)
    return out.loss


def classification_outputs(
    model: nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval step: class logits (float32) and labels."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs).logits.float(), batch["labels"]
