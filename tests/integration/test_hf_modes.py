"""LoRA on the CPU rig in every mode (Python API): the adapters train and are averaged, the
frozen base never leaves a rank (the final state and model.pt hold the adapters and the base's
fingerprint), and the state loads back onto the same base only (skipped without flodl[hf])."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.checkpoint.results import TrainedState

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from flodl.hf.data import text_dataset
from flodl.hf.models import auto_model
from flodl.hf.steps import causal_lm_step
from flodl.runtime.sync.trainable import base_fingerprint
from tests import hf_tiny

pytestmark = pytest.mark.slow


def lora_model(device, seed: int = 0):
    torch.manual_seed(seed)
    model = auto_model(config=hf_tiny.gpt2_config(), dtype="bfloat16", peft=hf_tiny.LORA)
    return model.to(device)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def lora_run(tmp_path, model=None, mode: str = "nccl_cadence", **cluster):
    """A 1-epoch LoRA run of the tiny GPT-2 on 2 rig ranks; ``cluster``: more ClusterConfig."""
    dataset = partial(
        text_dataset,
        "train",
        tokenizer=str(hf_tiny.tokenizer_dir(tmp_path)),
        files=[str(hf_tiny.text_file(tmp_path))],
        block_size=hf_tiny.BLOCK,
        cache_dir=str(tmp_path / "cache"),
    )
    rig = ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=2, **cluster)
    return (
        Trainer.builder(model or lora_model, adamw, causal_lm_step)
        .dataset(dataset)
        .batch_size(8)
        .num_epochs(1)
        .seed(0)
        .elche(ElCheConfig(mode=mode))
        .cluster(rig)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "job")
        .run()
    )


@pytest.mark.parametrize(
    "mode", ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
)
def test_lora_trains_in_every_mode_and_only_adapters_leave_the_ranks(tmp_path, mode):
    handle = lora_run(tmp_path, mode=mode)
    state = handle.join(timeout=240)
    assert handle.summary.status == "ok" and handle.result.coverage_exact
    fresh = lora_model("cpu")
    adapters = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert set(state.params) == adapters and state.base == base_fingerprint(fresh)
    moved = [n for n in adapters if "lora_B" in n and state.params[n].abs().sum() > 0]
    assert moved  # lora_B starts at zero: the adapters trained
    saved = torch.load(tmp_path / "job" / "model.pt", weights_only=True)
    assert set(saved["params"]) == adapters and saved["base"] == state.base
    TrainedState.load(tmp_path / "job" / "model.pt").load_into(fresh)
    assert all(
        torch.equal(p, state.params[n]) for n, p in fresh.named_parameters() if n in adapters
    )
    with pytest.raises(ValueError, match="frozen base"):
        state.load_into(lora_model("cpu", seed=1))


def base_per_process(device):
    """A factory that builds another random base in every rank process (as two hosts holding
    different weights under one path would)."""
    import os

    torch.manual_seed(os.getpid())
    return auto_model(config=hf_tiny.gpt2_config(), peft=hf_tiny.LORA).to(device)


def test_ranks_on_different_frozen_bases_are_refused_before_training(tmp_path):
    handle = lora_run(tmp_path, model=base_per_process)
    with pytest.raises(Exception, match="different frozen bases"):
        handle.join(timeout=240)
    assert handle.summary is None or handle.summary.status == "failed"


def test_lora_under_a_memory_plan_with_a_bf16_base(tmp_path):
    """The memory issue's plans apply to LoRA: rank 1 recomputes the GPT-2 blocks' activations
    and keeps the adapters' optimizer state on the host (the frozen bf16 base gets no host
    copy); the adapters train and only they leave the ranks."""
    handle = lora_run(tmp_path, memory_mb=[200, 200], memory_plan=["none", "recompute+offload"])
    state = handle.join(timeout=240)
    summary = handle.summary
    assert summary.status == "ok" and handle.result.coverage_exact
    assert "activation checkpointing, optimizer state on host" in summary.memory_plans[1]
    fresh = lora_model("cpu")
    adapters = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert set(state.params) == adapters
    assert any(state.params[n].abs().sum() > 0 for n in adapters if "lora_B" in n)
