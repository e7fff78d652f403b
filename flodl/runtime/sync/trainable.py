"""What trains, and so what is averaged, sent and checkpointed: parameters that require grad.

A frozen parameter (a LoRA adapter's base model, a frozen backbone) is the same on every rank -
every rank builds it from the same weights or the same seed - and never changes, so it never
crosses the wire: not in an average (any mode), not in a checkpoint's model shard, not in the
final state. Its stand-in is a fingerprint of its values, which a resume and an export compare,
so adapters trained on one base are never loaded onto another (docs/guides/hugging-face.md).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer changes: those that require grad, in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


def frozen_names(model: nn.Module) -> list[str]:
    """``state_dict`` names of the parameters that do not require grad (sorted), every name of
    a tied parameter included (GPT-2's ``lm_head.weight`` is its token embedding)."""
    named = model.named_parameters(remove_duplicate=False)
    return sorted(n for n, p in named if not p.requires_grad)


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> str | None:
    """SHA-256 (first 16 hex digits) of every frozen parameter's name, shape, dtype and bytes;
    None when nothing is frozen. Tied parameters count once (``named_parameters`` dedups)."""
    frozen = sorted((n, p) for n, p in model.named_parameters() if not p.requires_grad)
    if not frozen:
        return None
    digest = hashlib.sha256()
    for name, p in frozen:
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if p.device.type != "meta":
            flat = p.detach().to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def trainable_state(
    model: nn.Module, copy: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's ``state_dict`` without its frozen parameters, split into parameters and
    buffers, on CPU (``copy``: never the model's own tensors)."""
    buffer_names = {n for n, _ in model.named_buffers()}
    frozen = set(frozen_names(model))
    state = {
        k: v.detach().cpu().clone() if copy else v.detach().cpu()
        for k, v in model.state_dict().items()
        if k not in frozen
    }
    params = {k: v for k, v in state.items() if k not in buffer_names}
    return params, {k: v for k, v in state.items() if k in buffer_names}


def load_trainable(
    model: nn.Module, state: dict[str, torch.Tensor], fingerprint: str | None, what: str
) -> None:
    """Load a state saved by :func:`trainable_state` (all of it, or without the frozen base)
    into ``model``; refuse one saved on another frozen base (``ValueError`` naming ``what``)."""
    own = base_fingerprint(model)
    if fingerprint is not None and fingerprint != own:
        raise ValueError(
            f"{what} holds adapters trained on a frozen base with fingerprint {fingerprint}, "
            f"but this model's frozen base is {own}; load it onto the base it was trained on "
            "(the same model.pretrained, or the same model.config and seed)"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    left_out = set(missing) - set(frozen_names(model))
    if unexpected or left_out:
        raise ValueError(
            f"{what} does not fit this model: missing {sorted(left_out)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
