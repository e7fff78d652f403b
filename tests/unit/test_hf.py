"""model=hf, dataset=hf, task=causal_lm / seq_classification and the outputs, with real
transformers / datasets / peft / tokenizers objects (tiny, offline; skipped without flodl[hf])."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from flodl.checkpoint.results import TrainedState
from flodl.config import ConfigError, TargetConfig
from flodl.hf import data, steps
from flodl.hf.export import export
from flodl.hf.models import auto_model
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.trainable import (
    base_fingerprint,
    frozen_names,
    load_trainable,
    trainable_state,
)
from tests import hf_tiny


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _lora_model(seed: int = 0, dtype: str | None = None):
    torch.manual_seed(seed)
    return auto_model(config=hf_tiny.gpt2_config(), dtype=dtype, peft=hf_tiny.LORA)


def _adapter_numel(n_layer: int = 2, n_embd: int = 32, r: int = 2) -> int:
    # c_attn: n_embd -> 3 n_embd; lora_A r x n_embd, lora_B 3 n_embd x r, per layer
    return n_layer * (r * n_embd + 3 * n_embd * r)


# -- model=hf ------------------------------------------------------------------------------------
def test_lora_on_a_bf16_base_trains_only_float32_adapters():
    model = _lora_model(dtype="bfloat16")
    trains = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all("lora_" in n for n in trains)
    assert {p.dtype for p in trains.values()} == {torch.float32}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert sum(p.numel() for p in trains.values()) == _adapter_numel()
    ids = torch.randint(0, hf_tiny.VOCAB, (3, hf_tiny.BLOCK))
    loss = steps.causal_lm_step(model, {"input_ids": ids})
    loss.backward()
    assert all(p.grad is not None for p in trains.values())
    # lora_B starts at zero (the adapted model is the base), so only B has a gradient yet
    assert all(p.grad.abs().sum() > 0 for n, p in trains.items() if "lora_B" in n)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_seq_classification_head_uses_the_models_own_loss():
    torch.manual_seed(0)
    model = auto_model(head="seq_classification", config=hf_tiny.gpt2_config(), num_labels=3)
    model.eval()  # no dropout: the step's loss and the eval logits see the same network
    batch = {
        "input_ids": torch.randint(1, hf_tiny.VOCAB, (4, hf_tiny.BLOCK)),
        "attention_mask": torch.ones(4, hf_tiny.BLOCK, dtype=torch.int64),
        "labels": torch.tensor([0, 1, 2, 1]),
    }
    loss = steps.seq_classification_step(model, batch)
    logits, labels = steps.classification_outputs(model, batch)
    assert logits.shape == (4, 3) and torch.equal(labels, batch["labels"])
    assert float(loss) == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)))
    with pytest.raises(ValueError, match=r"dataset\.label_column"):
        steps.seq_classification_step(model, {"input_ids": batch["input_ids"]})


def test_pretrained_weights_load_from_a_local_directory(tmp_path):
    path = hf_tiny.pretrained_dir(tmp_path)
    model = auto_model(pretrained=str(path))
    import transformers

    saved = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    for (n, a), (_, b) in zip(model.state_dict().items(), saved.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name", ["./no-such-model", "nobody/no-such-model"])
def test_a_missing_model_is_one_line_naming_the_path_and_how_to_fetch_it(name):
    with pytest.raises(ConfigError) as err:
        auto_model(pretrained=name)
    message = str(err.value)
    assert "\n" not in message and f"model.pretrained={name}" in message
    assert "huggingface-cli download" in message


def test_config_and_pretrained_are_exclusive_and_bad_knobs_are_named():
    with pytest.raises(ConfigError, match="set exactly one"):
        auto_model(pretrained="x", config=hf_tiny.gpt2_config())
    with pytest.raises(ConfigError, match=r"model\.head=seq2seq"):
        auto_model(head="seq2seq", config=hf_tiny.gpt2_config())
    with pytest.raises(ConfigError, match=r"model\.dtype=int8"):
        auto_model(config=hf_tiny.gpt2_config(), dtype="int8")
    with pytest.raises(ConfigError, match="model_type"):
        auto_model(config={"n_layer": 2})


# -- what trains, travels and is saved --------------------------------------------------------
def test_the_averaged_state_is_the_adapters_only():
    model = _lora_model(dtype="bfloat16")
    state = FlatState(model, share_storage=True)
    adapter_bytes = 4 * _adapter_numel()
    assert state.n_params == _adapter_numel()
    assert state.flatten().numel() * state.flatten().element_size() == adapter_bytes
    assert state.shared() is not None  # fp32 adapters share one buffer: averaged in place
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert adapter_bytes < full / 10


def test_the_saved_state_leaves_the_base_out_and_refuses_another_base():
    model = _lora_model(seed=0)
    params, _ = trainable_state(model, copy=True)
    assert set(params) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.endswith("lm_head.weight") for n in params)  # tied to the frozen wte
    assert "base_model.model.lm_head.weight" in frozen_names(model)
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    same = _lora_model(seed=0)
    load_trainable(same, params, base_fingerprint(model), "test state")
    for n, p in same.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, params[n])
    other = _lora_model(seed=1)
    assert base_fingerprint(other) != base_fingerprint(model)
    with pytest.raises(ValueError, match="frozen base"):
        load_trainable(other, params, base_fingerprint(model), "test state")


def test_trained_state_round_trips_with_its_base_fingerprint(tmp_path):
    model = _lora_model(seed=0)
    params, buffers = trainable_state(model, copy=True)
    state = TrainedState(params, buffers, base=base_fingerprint(model))
    state.save(tmp_path / "model.pt")
    back = TrainedState.load(tmp_path / "model.pt")
    assert back.base == state.base and back.params.keys() == params.keys()
    back.load_into(_lora_model(seed=0))
    with pytest.raises(ValueError, match="frozen base"):
        back.load_into(_lora_model(seed=3))


# -- dataset=hf ------------------------------------------------------------------------------------
def test_text_files_are_tokenized_packed_and_cached(tmp_path, monkeypatch):
    tok = hf_tiny.tokenizer_dir(tmp_path)
    kwargs = {
        "tokenizer": str(tok),
        "files": [str(hf_tiny.text_file(tmp_path))],
        "block_size": hf_tiny.BLOCK,
        "cache_dir": str(tmp_path / "cache"),
    }
    train = data.text_dataset("train", **kwargs)
    test = data.text_dataset("test", **kwargs)
    ids = train.tensors["input_ids"]
    assert ids.shape[1] == hf_tiny.BLOCK and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < hf_tiny.VOCAB
    assert 5 * len(test) < len(train) < 15 * len(test)  # val_fraction 0.1 of the rows
    assert set(train[0]) == {"input_ids"}
    tokenizer = data.load_tokenizer(str(tok))
    first_line = hf_tiny.text().split("\n")[0]
    expected = tokenizer(first_line, add_special_tokens=False)["input_ids"][: hf_tiny.BLOCK]
    assert ids[0].tolist() == expected
    monkeypatch.setattr(data, "_pack", lambda *a: pytest.fail("tokenized again"))
    again = data.text_dataset("train", **kwargs)
    assert torch.equal(again.tensors["input_ids"], ids)


def test_a_saved_dataset_with_labels_gives_classification_samples(tmp_path):
    import datasets

    rows = {"text": ["good dog", "bad cat", "far home", "quick fox"] * 5, "label": [1, 0, 2, 1] * 5}
    parts = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(rows), test=datasets.Dataset.from_dict(rows).select([0, 1])
    )
    parts.save_to_disk(str(tmp_path / "saved"))
    kwargs = {
        "tokenizer": str(hf_tiny.tokenizer_dir(tmp_path)),
        "saved": str(tmp_path / "saved"),
        "label_column": "label",
        "block_size": 8,
        "cache_dir": str(tmp_path / "cache"),
    }
    train = data.text_dataset("train", **kwargs)
    test = data.text_dataset("test", **kwargs)
    assert len(train) == 20 and len(test) == 2  # the source's own test split
    sample = train[1]
    assert set(sample) == {"input_ids", "attention_mask", "labels"}
    assert sample["input_ids"].shape == (8,) and int(sample["labels"]) == 0
    assert int(sample["attention_mask"].sum()) < 8  # "bad cat" is padded
    with pytest.raises(ConfigError, match="label_column=stars"):
        data.text_dataset("train", **(kwargs | {"label_column": "stars"}))


def test_a_tokenizer_is_trained_once_where_none_is_named(tmp_path):
    kwargs = {
        "text_fn": "tests.hf_tiny.text",
        "train_tokenizer_vocab": hf_tiny.VOCAB,
        "block_size": hf_tiny.BLOCK,
        "cache_dir": str(tmp_path),
    }
    train = data.text_dataset("train", **kwargs)
    path = data.dataset_tokenizer(kwargs)
    assert path.startswith(str(tmp_path)) and (tmp_path / path).exists()
    assert len(data.load_tokenizer(path)) <= hf_tiny.VOCAB
    assert int(train.tensors["input_ids"].max()) < hf_tiny.VOCAB
    with pytest.raises(ConfigError, match=r"train_tokenizer_vocab=200: .* at least 257"):
        data.text_dataset("train", **(kwargs | {"train_tokenizer_vocab": 200}))
    with pytest.raises(ConfigError, match=r"dataset\.tokenizer="):
        nothing = {"tokenizer": str(tmp_path / "none"), "train_tokenizer_vocab": None}
        data.text_dataset("train", **(kwargs | nothing))
    with pytest.raises(ConfigError, match="exactly one"):
        data.text_dataset("train", tokenizer=path, files=["a.txt"], text_fn="x.y")


# -- task=causal_lm ------------------------------------------------------------------------------
def test_perplexity_is_exp_of_the_eval_loss():
    from torchmetrics.text import Perplexity

    model = _lora_model().eval()
    ids = torch.randint(0, hf_tiny.VOCAB, (4, hf_tiny.BLOCK))
    with torch.no_grad():
        preds, target = steps.causal_lm_outputs(model, {"input_ids": ids})
        loss = steps.token_cross_entropy(preds, target)
        own = model(input_ids=ids, labels=ids).loss
    metric = Perplexity()
    metric.update(preds, target)
    assert float(metric.compute()) == pytest.approx(math.exp(float(loss)), rel=1e-4)
    assert float(own) == pytest.approx(float(loss), rel=1e-5)  # the model's own loss


# -- outputs ---------------------------------------------------------------------------------------
_LOAD_WITHOUT_FLODL = """
import json, sys, torch, transformers, peft
out, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
if sys.argv[3] == "lora":
    cfg = peft.PeftConfig.from_pretrained(out + "/adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(cfg.base_model_name_or_path)
    model = peft.PeftModel.from_pretrained(base, out + "/adapter")
    tok = transformers.AutoTokenizer.from_pretrained(out + "/adapter")
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(out + "/model")
    tok = transformers.AutoTokenizer.from_pretrained(out + "/model")
assert not [m for m in sys.modules if m.startswith("flodl")]
with torch.no_grad():
    logits = model(input_ids=ids).logits.float()
print(json.dumps({"logits": logits.reshape(-1).tolist(), "vocab": len(tok)}))
"""


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_outputs_load_with_from_pretrained_without_flodl(tmp_path, lora):
    fields = {"config": hf_tiny.gpt2_config(), **({"peft": hf_tiny.LORA} if lora else {})}
    target = TargetConfig.model_validate({"_target_": "flodl.hf.models.auto_model", **fields})
    torch.manual_seed(7)
    trained = auto_model(**fields)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))  # "training": the adapters moved
    params, buffers = trainable_state(trained, copy=True)
    state = TrainedState(params, buffers, base=base_fingerprint(trained))
    tok = hf_tiny.tokenizer_dir(tmp_path)
    out = export(target, state, tmp_path / "job", seed=7, tokenizer=str(tok))
    assert (out / ("adapter" if lora else "model")).is_dir()
    assert list(out.rglob("*.safetensors")) and not list(out.rglob("*.bin"))
    ids = torch.randint(0, hf_tiny.VOCAB, (2, 8))
    with torch.no_grad():
        expected = trained.eval()(input_ids=ids).logits.float()  # from_pretrained: eval mode
    run = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_FLODL, str(out), json.dumps(ids.tolist()),
         "lora" if lora else "full"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert torch.allclose(torch.tensor(loaded["logits"]).view_as(expected), expected, atol=1e-5)
    assert loaded["vocab"] == len(data.load_tokenizer(str(tok)))


def test_export_refuses_a_state_trained_on_another_base(tmp_path):
    fields = {"config": hf_tiny.gpt2_config(), "peft": hf_tiny.LORA}
    target = TargetConfig.model_validate({"_target_": "flodl.hf.models.auto_model", **fields})
    torch.manual_seed(1)
    trained = auto_model(**fields)
    params, buffers = trainable_state(trained)
    state = TrainedState(params, buffers, base=base_fingerprint(trained))
    with pytest.raises(ValueError, match="frozen base"):
        export(target, state, tmp_path / "job", seed=2)  # another seed: another random base


def test_a_bf16_base_with_lora_holds_a_fraction_of_a_full_fine_tunes_memory():
    """What the rig's device-memory model charges a rank between steps (flodl/rig/device_memory.py):
    the frozen base at 2 bytes a parameter, the adapters with their gradients and AdamW state."""
    from flodl.rig.device_memory import training_state

    def state_bytes(model) -> int:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        ids = torch.randint(0, hf_tiny.VOCAB, (2, hf_tiny.BLOCK))
        steps.causal_lm_step(model, {"input_ids": ids}).backward()
        optimizer.step()
        return sum(t.numel() * t.element_size() for t in training_state(model, optimizer))

    lora = _lora_model(dtype="bfloat16")
    torch.manual_seed(0)
    full = auto_model(config=hf_tiny.gpt2_config())
    n_base = sum(p.numel() for p in lora.parameters() if not p.requires_grad)
    n_adapters = _adapter_numel()
    adapter_tensors = sum(1 for p in lora.parameters() if p.requires_grad)
    # base in bf16; adapters: weights, grads, exp_avg, exp_avg_sq in fp32, and AdamW's step
    assert state_bytes(lora) == 2 * n_base + 16 * n_adapters + 4 * adapter_tensors
    n_full = sum(p.numel() for p in full.parameters())
    assert state_bytes(full) == 16 * n_full + 4 * sum(1 for _ in full.parameters())
    assert state_bytes(_lora_model(dtype="bfloat16")) < 0.2 * state_bytes(full)
