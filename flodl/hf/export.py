"""A Hugging Face job's outputs, loadable without flodl: ``save_pretrained`` (safetensors) in the
job directory, the tokenizer beside each.

``<job>/hf/model/``    the trained model (``AutoModelFor<head>.from_pretrained``), without LoRA
``<job>/hf/adapter/``  with LoRA: the averaged adapters (``PeftModel.from_pretrained(base, dir)``)
``<job>/hf/base/``     with LoRA on a base built from a config: that base (random weights from
                       the seed), which the adapter's config names; a pretrained base is named
                       by its own path instead

The launcher builds the model once more on CPU, with the ranks' seed, and loads the trained
state: with LoRA that state holds the adapters only, and it is loaded only onto a base whose
fingerprint matches the one the ranks trained on (:mod:`flodl.runtime.sync.trainable`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from flodl.checkpoint.results import TrainedState
from flodl.config import TargetConfig
from flodl.config.factories import instantiate

log = logging.getLogger("flodl")

__all__ = ["export", "is_hf_model"]


def is_hf_model(model: TargetConfig) -> bool:
    return model.target.startswith("flodl.hf.")


def export(
    model_cfg: TargetConfig,
    state: TrainedState,
    job_dir: Path,
    seed: int,
    tokenizer: str | None = None,
) -> Path:
    """Write the job's Hugging Face outputs under ``job_dir/hf``; return that directory."""
    torch.manual_seed(seed)  # as the ranks did: a base built from a config is the same base
    model = instantiate(model_cfg)
    state.load_into(model)
    out = Path(job_dir) / "hf"
    kwargs = model_cfg.kwargs()
    if hasattr(model, "peft_config"):
        _save_lora(model, out, kwargs.get("pretrained"))
        dirs = [out / "adapter"] + ([out / "base"] if kwargs.get("pretrained") is None else [])
    else:
        model.save_pretrained(str(out / "model"), safe_serialization=True)
        dirs = [out / "model"]
    if tokenizer is not None:
        from flodl.hf.data import load_tokenizer

        tok = load_tokenizer(tokenizer)
        for d in dirs:
            tok.save_pretrained(str(d))
    log.info("Hugging Face outputs: %s", ", ".join(str(d) for d in dirs))
    return out


def _save_lora(model: Any, out: Path, pretrained: str | None) -> None:
    """The adapters, then (for a base built from a config) the base they belong to."""
    if pretrained is not None:
        from flodl.hf.models import resolve_pretrained

        base_path = resolve_pretrained(pretrained)
    else:
        base_path = str((out / "base").resolve())
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_path
    if pretrained is None:  # the base's config first: peft reads it while saving the adapters
        model.get_base_model().config.save_pretrained(str(out / "base"))
    model.save_pretrained(str(out / "adapter"), safe_serialization=True)
    if pretrained is None:
        base = model.unload()  # the base without the adapters' layers (not merged)
        base.save_pretrained(str(out / "base"), safe_serialization=True)
