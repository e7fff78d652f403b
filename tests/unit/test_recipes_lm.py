"""The language-model recipes: text datasets, vocabulary, char-rnn, gpt-nano, their configs."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from flodl.cli.app import build_dataset, build_model, build_optimizer, build_scheduler, plain_config
from flodl.config import validate_run_config
from flodl.recipes import text
from flodl.recipes.lm import CharRNN, GPTNano
from flodl.recipes.steps import bits_per_char, language_model_step, val_loss
from flodl.trainer import TrainedState

CONF = Path(__file__).resolve().parents[2] / "conf"
VOCAB = text.TINY_SHAKESPEARE_VOCAB
SMALL = 40_000  # characters of the offline corpus the training smoke tests read


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: beside the suite's other xdist worker (or anything else busy), two
    spinning OpenMP threads per process made these steps ~10x slower (measured: 34 s vs 3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- vocabulary and datasets ---------------------------------------------------------------------


def test_tiny_shakespeare_vocab_is_its_65_characters() -> None:
    assert len(VOCAB) == 65 and "".join(sorted(set(VOCAB))) == VOCAB
    assert VOCAB.startswith("\n !$&',-.3:;?A") and VOCAB.endswith("xyz")


def test_encode_decode_round_trip_and_unknown_characters() -> None:
    sample = text.offline_corpus()[100_000:102_000]
    ids = text.encode(sample, VOCAB)
    assert ids.dtype == torch.int64 and int(ids.max()) < 65
    assert text.decode(ids, VOCAB) == sample
    assert text.decode(text.encode("Ab\nz", "\nAbz"), "\nAbz") == "Ab\nz"
    with pytest.raises(ValueError, match=r"outside the vocabulary: \['\[', '\]'\]"):
        text.encode("[Exit]", VOCAB)


def test_offline_corpus_is_the_shipped_gutenberg_plays_in_the_tiny_alphabet() -> None:
    corpus = text.offline_corpus()
    assert 5_000_000 < len(corpus) < 5_100_000
    assert set(corpus) <= set(VOCAB)
    assert "To be, or not to be" in corpus and "HAMLET" in corpus


def test_shakespeare_split_is_fixed_disjoint_and_shifted_by_one() -> None:
    train = text.shakespeare("train", block_size=32, max_chars=SMALL)
    val = text.shakespeare("test", block_size=32, max_chars=SMALL)
    corpus = text.offline_corpus()[:SMALL]
    cut = int(SMALL * 0.9)
    assert train.text_chars == cut and val.text_chars == SMALL - cut
    assert len(train) == (cut - 1) // 32 and len(val) == (SMALL - cut - 1) // 32
    x, y = train.tensors
    assert x.shape == y.shape == (len(train), 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x one character ahead
    assert (
        train.decode(x[0]) == corpus[:32]
        and train.decode(y[-1]) == corpus[32 * len(x) - 31 : 32 * len(x) + 1]
    )
    assert val.decode(val.tensors[0][0]) == corpus[cut : cut + 32]  # validation = the tail
    again = text.shakespeare("train", block_size=32, max_chars=SMALL)
    assert torch.equal(again.tensors[0], x) and train.vocab == VOCAB


def test_block_size_knob_and_its_errors() -> None:
    assert text.shakespeare("test", block_size=8, max_chars=1000).tensors[0].shape == (12, 8)
    with pytest.raises(ValueError, match=r"block_size=0: must be >= 1"):
        text.shakespeare("train", block_size=0)
    with pytest.raises(ValueError, match=r"block_size=200: the split holds only 100 characters"):
        text.shakespeare("test", block_size=200, max_chars=1000)
    with pytest.raises(ValueError, match=r"source='gutenberg': must be one of offline, tiny"):
        text.shakespeare("train", source="gutenberg")
    with pytest.raises(
        ValueError,
        match=r"shakespeare: vocab: text holds \d+ character\(s\) outside the vocabulary",
    ):
        text.shakespeare("train", vocab="abc", max_chars=1000)


def test_char_text_derives_the_vocabulary_of_your_own_file(tmp_path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("hello world, héllo wörld!\n" * 40, encoding="utf-8")
    train = text.char_text(str(path), "train", block_size=16)
    val = text.char_text(str(path), "test", block_size=16)
    assert train.vocab == val.vocab == "".join(sorted(set(path.read_text())))
    assert "é" in train.vocab and train.decode(train.tensors[0][0]) == path.read_text()[:16]


# --- the tiny-shakespeare downloader (fake mirror, no network) -----------------------------------


@pytest.fixture
def fake_tiny(tmp_path, monkeypatch):
    """A file:// mirror serving a stand-in input.txt, its SHA-256 patched in."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    body = text.offline_corpus()[:5000]
    (mirror / "input.txt").write_text(body, encoding="utf-8")
    digest = hashlib.sha256(body.encode()).hexdigest()
    monkeypatch.setattr(text, "TINY_SHAKESPEARE_SHA256", digest)
    return mirror, body


def test_tiny_downloads_verifies_and_caches(fake_tiny, tmp_path) -> None:
    mirror, body = fake_tiny
    cache = tmp_path / "cache"
    mirrors = [f"file://{tmp_path}/nowhere/", f"file://{mirror}"]  # the first one fails
    val = text.shakespeare(
        "test", source="tiny", block_size=16, cache_dir=str(cache), mirrors=mirrors
    )
    assert val.decode(val.tensors[0][0]) == body[4500:4516]
    assert (cache / "input.txt").read_text() == body
    (mirror / "input.txt").unlink()  # the cache serves the second call on its own
    again = text.shakespeare(
        "test", source="tiny", block_size=16, cache_dir=str(cache), mirrors=mirrors
    )
    assert torch.equal(again.tensors[0], val.tensors[0])


def test_tiny_checksum_mismatch_raises_and_keeps_nothing(fake_tiny, tmp_path, monkeypatch) -> None:
    mirror, _ = fake_tiny
    monkeypatch.setattr(text, "TINY_SHAKESPEARE_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match=r"input\.txt.*checksum mismatch: sha256"):
        text.shakespeare("train", source="tiny", cache_dir=str(cache), mirrors=[f"file://{mirror}"])
    assert list(cache.iterdir()) == []


# --- models ---------------------------------------------------------------------------------------


def test_char_rnn_has_the_ddp_bench_shape() -> None:
    model = CharRNN(VOCAB)
    assert model.embed.num_embeddings == 65 and model.embed.embedding_dim == 128
    assert (model.lstm.hidden_size, model.lstm.num_layers, model.lstm.dropout) == (256, 2, 0.2)
    lstm = 4 * 256 * (128 + 256 + 2) + 4 * 256 * (256 + 256 + 2)
    assert n_params(model) == 65 * 128 + lstm + 256 * 65 + 65
    assert model(torch.zeros(3, 10, dtype=torch.long)).shape == (3, 10, 65)


def test_gpt_nano_shape_tied_head_and_causality() -> None:
    torch.manual_seed(0)
    model = GPTNano(VOCAB, block_size=64).eval()
    assert model.head.weight is model.tok.weight  # tied
    assert len(model.blocks) == 4 and model.blocks[0].heads == 4
    per_block = (
        2 * 2 * 128 + (128 * 384 + 384) + (128 * 128 + 128) + (128 * 512 + 512) + (512 * 128 + 128)
    )
    assert n_params(model) == 65 * 128 + 64 * 128 + 4 * per_block + 2 * 128
    assert n_params(GPTNano(VOCAB, tie_head=False)) == n_params(model) + 65 * 128
    x = torch.randint(0, 65, (2, 64))
    y = x.clone()
    y[:, 40:] = (y[:, 40:] + 1) % 65  # change only the future
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 64, 65)
    assert torch.allclose(a[:, :40], b[:, :40], atol=1e-6)  # the past does not see it
    assert not torch.allclose(a[:, 40:], b[:, 40:])
    with pytest.raises(ValueError, match=r"65 positions exceeds block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("cls", [CharRNN, GPTNano])
def test_the_vocabulary_is_saved_with_the_weights(cls, tmp_path) -> None:
    model = cls(VOCAB)
    buffers = dict(model.named_buffers())  # split like the ranks do (state_dict by name)
    params = {k: v for k, v in model.state_dict().items() if k not in buffers}
    state = TrainedState(params=params, buffers=buffers)
    state.save(tmp_path / "model.pt")
    fresh = TrainedState.load(tmp_path / "model.pt").load_into(cls(VOCAB))
    assert fresh.vocab == VOCAB
    loaded = TrainedState.load(tmp_path / "model.pt")
    saved = "".join(chr(int(c)) for c in loaded.buffers["vocab_codes"])
    assert saved == VOCAB  # readable from model.pt alone, without building a model
    assert cls(65).vocab is None and cls(65).head.out_features == 65
    with pytest.raises(ValueError, match=r"vocab=None: give the vocabulary string"):
        cls(None)


@pytest.mark.parametrize(
    ("cls", "optim", "kwargs"),
    [
        (CharRNN, lambda p: torch.optim.RMSprop(p, 2e-3), {}),
        (GPTNano, lambda p: torch.optim.Adam(p, 3e-3), {"block_size": 32}),
    ],
)
def test_a_few_steps_lower_the_loss_and_eval_is_finite(cls, optim, kwargs) -> None:
    torch.manual_seed(0)
    train = text.shakespeare("train", block_size=32, max_chars=SMALL)
    val = text.shakespeare("test", block_size=32, max_chars=SMALL)
    model = cls(train.vocab, **kwargs)
    opt = optim(model.parameters())
    before = val_loss(model, *val.tensors)
    assert before == pytest.approx(math.log(65), abs=0.3)  # uniform-ish at init
    x, y = train.tensors
    losses = []
    for step in range(25):
        idx = torch.arange(step * 16, step * 16 + 16) % len(x)
        opt.zero_grad()
        loss = language_model_step(model, (x[idx], y[idx]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = val_loss(model, *val.tensors)
    assert math.isfinite(after) and after < before - 0.5
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    assert bits_per_char(model, *val.tensors) == pytest.approx(after / math.log(2))


# --- configs ---------------------------------------------------------------------------------


def _run_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return validate_run_config(plain_config(compose(config_name="config", overrides=overrides)))


def test_model_char_rnn_selects_its_dataset_task_and_rmsprop() -> None:
    run = _run_config(["model=char_rnn", "dataset.block_size=16", "dataset.max_chars=20000"])
    assert run.task.train_step == "flodl.recipes.steps.language_model_step"
    assert run.task.eval_metric == "val_loss" and run.task.eval_higher_is_better is False
    model = build_model(run.model, "cpu")
    assert isinstance(model, CharRNN) and model.embed.num_embeddings == 65 and model.vocab == VOCAB
    opt = build_optimizer(run.optimizer, model.parameters())
    assert isinstance(opt, torch.optim.RMSprop) and opt.defaults["lr"] == 2e-3
    val = build_dataset(run.dataset, "test")
    assert val.tensors[0].shape[1] == 16 and val.vocab == model.vocab


def test_model_gpt_nano_follows_block_size_and_uses_adam_3e_4() -> None:
    run = _run_config(["model=gpt_nano", "dataset.block_size=48"])
    model = build_model(run.model, "cpu")
    assert isinstance(model, GPTNano) and model.block_size == 48 and model.tok.num_embeddings == 65
    opt = build_optimizer(run.optimizer, model.parameters())
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["lr"] == 3e-4
    # 20 % linear warm-up, then cosine to 1e-5, per optimizer step (the global progress clock)
    assert run.scheduler is not None and run.scheduler.interval == "step"
    scheduler = build_scheduler(run.scheduler, opt, total_steps=100)
    lrs = []
    for _ in range(101):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs[0] < 2e-5 and lrs[10] == pytest.approx(1.5e-4, rel=0.1)
    assert lrs[20] == pytest.approx(3e-4) == max(lrs)
    assert lrs[60] == pytest.approx((3e-4 + 1e-5) / 2, rel=1e-3)
    assert lrs[100] == pytest.approx(1e-5, rel=1e-6)
    flat = _run_config(["model=gpt_nano", "~scheduler"])
    assert flat.scheduler is None and flat.model.target == "flodl.recipes.lm.GPTNano"
