"""``model=hf``: a transformers model for a task head, from a config or local weights, with
optional LoRA adapters (``model.peft``) and a frozen base in another dtype.

Offline by design: weights come from a local directory or the local Hugging Face cache, never
the network; a missing model is one line naming the path and how to fetch it (exit code 2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flodl.config import ConfigError

__all__ = ["HEADS", "auto_model", "resolve_pretrained"]

#: model.head -> the transformers Auto class that builds it
HEADS = {
    "causal_lm": "AutoModelForCausalLM",
    "seq_classification": "AutoModelForSequenceClassification",
}
_PEFT_TASK = {"causal_lm": "CAUSAL_LM", "seq_classification": "SEQ_CLS"}
_DTYPES = ("float32", "bfloat16", "float16")


def auto_model(
    head: str = "causal_lm",
    pretrained: str | None = None,
    config: Mapping[str, Any] | str | None = None,
    dtype: str | None = None,
    peft: Mapping[str, Any] | None = None,
    num_labels: int | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """``AutoModelFor<head>`` from local weights (``pretrained``: a directory or a Hub id found in
    the local cache) or from a ``config`` (a mapping with ``model_type``, or a local config
    file or directory): random weights from the run's seed. ``dtype``: the weights' dtype (with
    ``peft``: the frozen base's; the adapters train in float32). ``peft``: LoRA's ``r``,
    ``lora_alpha``, ``lora_dropout``, ``target_modules`` (any ``peft.LoraConfig`` field)."""
    import torch
    import transformers

    if head not in HEADS:
        raise ConfigError(f"model.head={head}: must be one of {', '.join(HEADS)}")
    if (pretrained is None) == (config is None):
        raise ConfigError(
            "model.pretrained / model.config: set exactly one (local weights, or a config to "
            "build random weights from)"
        )
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"model.dtype={dtype}: must be one of {', '.join(_DTYPES)} or null")
    auto = getattr(transformers, HEADS[head])
    extra: dict[str, Any] = {"num_labels": num_labels} if num_labels is not None else {}
    torch_dtype = getattr(torch, dtype) if dtype is not None else None
    if pretrained is not None:
        path = resolve_pretrained(pretrained)
        model = auto.from_pretrained(
            path, trust_remote_code=trust_remote_code, dtype=torch_dtype or "float32", **extra
        )
    else:
        model = auto.from_config(_config(config, trust_remote_code, extra), dtype=torch_dtype)
    if peft is None:
        return model
    return _with_lora(model, dict(peft), head)


def _config(config: Any, trust_remote_code: bool, extra: dict[str, Any]) -> Any:
    import transformers

    if isinstance(config, str):
        path = Path(config).expanduser()
        if not path.exists():
            raise ConfigError(f"model.config={config}: no such file or directory")
        return transformers.AutoConfig.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, **extra
        )
    fields = _plain(config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.config: needs model_type (e.g. gpt2, llama, bert)")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields, **extra)
    except ValueError as exc:
        raise ConfigError(f"model.config.model_type={model_type}: {exc}") from None


def _with_lora(model: Any, fields: dict[str, Any], head: str) -> Any:
    """Wrap ``model`` in LoRA adapters: the base is frozen in its dtype, the adapters (and a
    classification head, which peft keeps trainable) are float32."""
    import peft
    import torch

    fields = _plain(fields)
    fields.setdefault("task_type", _PEFT_TASK[head])
    try:
        lora = peft.LoraConfig(**fields)
    except TypeError as exc:
        raise ConfigError(f"model.peft: {exc}") from None
    try:
        wrapped = peft.get_peft_model(model, lora)
    except ValueError as exc:
        raise ConfigError(
            f"model.peft.target_modules={fields.get('target_modules')}: {exc}"
        ) from None
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return wrapped


def _plain(value: Any) -> Any:
    """Hydra hands nested config as DictConfig / ListConfig: plain dicts and lists for HF."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def resolve_pretrained(name: str) -> str:
    """A local directory, or a Hub id found in the local Hugging Face cache (offline: nothing
    is downloaded). Refuses in one line naming the path and how to fetch it."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    looks_like_id = not name.startswith((".", "/", "~")) and name.count("/") <= 1
    if looks_like_id:
        try:
            from huggingface_hub import snapshot_download

            return str(snapshot_download(name, local_files_only=True))
        except Exception:  # not in the cache (or not an id at all): the refusal below
            pass
    cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
    raise ConfigError(
        f"model.pretrained={name}: no such local directory, and not in the Hugging Face cache "
        f"({cache}); fetch it first: huggingface-cli download {name if looks_like_id else '<id>'}"
        f"{'' if looks_like_id else f' --local-dir {name}'}"
    )
