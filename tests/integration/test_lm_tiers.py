"""The language models through the Python tiers, in-process (one rank: no rank process, hence
``light``; the 2-rank run through run.py is tests/e2e/test_run_py.py's ddp_bench test).

* managed: the language-model guide's "train a character model on your own text file" example,
  run as written; only the file name, the epoch count and the cluster are swapped, and each swap is
  asserted to have happened, so a README edit that drops one fails here;
* cooperative: gpt-nano with its per-step warm-up + cosine schedule under ``into_worker()``.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from flodl.recipes.text import offline_corpus

README = Path(__file__).resolve().parents[2] / "docs" / "guides" / "language-models.md"
MARKER = "Train a character model on your own text file"


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: beside the suite's other xdist worker (or anything else busy), two
    spinning OpenMP threads per process made these steps ~10x slower (measured: 34 s vs 3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _example() -> str:
    text = README.read_text()
    start = text.index(MARKER)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, "no python block after the LM example's heading"
    return match.group(1)


def _swap(code: str, old: str, new: str) -> str:
    assert old in code, f"README example no longer contains {old!r}"
    return code.replace(old, new)


@pytest.mark.light
def test_readme_char_model_example_trains_and_keeps_the_vocabulary(tmp_path, capsys) -> None:
    corpus = tmp_path / "plays.txt"
    corpus.write_text(offline_corpus()[:16_000] + "café\n")  # a character tiny-shakespeare lacks
    code = _swap(_example(), '"my_text.txt"', repr(str(corpus)))
    code = _swap(code, ".num_epochs(5)", ".num_epochs(3)")
    code = _swap(
        code,
        'ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5])',
        'ClusterConfig(kind="cpu_rig", ranks=1)',
    )
    code = _swap(code, ".run()", f".output_dir({str(tmp_path / 'job')!r}).run()")
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    train, model, handle = scope["train"], scope["model"], scope["handle"]
    assert "é" in train.vocab and model.vocab == train.vocab
    assert model.embed.num_embeddings == len(train.vocab)
    summary = handle.result.summary
    assert summary.status == "ok" and summary.epochs == 3
    # 3 epochs of 224 windows (12 steps): well below the uniform guess ln(V) = 4.2 nats/char
    uniform = math.log(len(train.vocab))
    assert math.isfinite(summary.eval_value) and summary.eval_value < uniform - 0.6
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"True {summary.eval_value}"


@pytest.mark.light
def test_gpt_nano_cooperative_tier_with_its_per_step_schedule(tmp_path) -> None:
    import torch

    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.recipes.lm import GPTNano
    from flodl.recipes.steps import language_model_step, val_loss
    from flodl.recipes.text import shakespeare
    from flodl.step.schedules import warmup_cosine

    def data(split: str):
        return shakespeare(split, block_size=16, max_chars=9000)

    worker = (
        Trainer.builder(
            lambda dev: GPTNano(data("train").vocab, block_size=16),
            lambda params: torch.optim.Adam(params, 3e-3),
            language_model_step,
        )
        .dataset(lambda: data("train"))
        .batch_size(16)
        .num_epochs(2)
        .scheduler(
            lambda opt, total_steps: warmup_cosine(opt, total_steps, 0.2, 1e-5 / 3e-3),
            interval="step",
        )
        .cluster(ClusterConfig(kind="cpu_rig", ranks=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path)
        .into_worker()
    )
    lrs = []
    for _epoch in worker.epochs():
        for batch in worker.batches():
            worker.optimizer.zero_grad()
            loss = language_model_step(worker.model, batch)
            loss.backward()
            worker.optimizer.step()
            worker.step(loss)
            lrs.append(worker.optimizer.param_groups[0]["lr"])
    state = worker.finish()
    steps = 2 * -(-len(data("train")) // 16)  # 2 epochs of 506 windows in batches of 16
    assert len(lrs) == steps == 64
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(3e-3, rel=0.05) and 8 <= peak <= 16  # warm-up: 20 %
    assert lrs[-1] < 3e-4 and all(a >= b for a, b in itertools.pairwise(lrs[peak:]))
    model = state.load_into(GPTNano(data("train").vocab, block_size=16))
    assert model.vocab == data("train").vocab
    assert val_loss(model, *data("test").tensors) < math.log(65) - 0.8
