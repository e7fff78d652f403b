"""The README's "train a character model on your own text file" example, run as written.

Only the file name, the epoch count and the cluster (one rank: in-process, no rank process,
hence ``light``) are swapped; each swap is asserted to have happened, so a README edit that
drops one fails here instead of silently testing something else.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from recipes.text import offline_corpus

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "Train a character model on your own text file"


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
    exec(compile(code, "README.md", "exec"), scope)
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
