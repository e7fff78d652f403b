"""``experiment=hf_lora`` end to end through run.py, offline: a tiny GPT-2 from a config, its
frozen base in bf16, a tokenizer trained on the offline corpus, 2 rig ranks, a checkpoint every
epoch, rank 1 lost mid-run, a resume, a resume onto another base refused, and a missing model
refused before any rank (skipped without flodl[hf])."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("datasets")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["dataset.max_chars=40000", "trainer.batch_size=8", "logger.progress=lines"]


def run_py(args: list[str], tmp: Path, sweep: str, chaos: str | None = None):
    env = {**os.environ, "FLODL_DATA_DIR": str(tmp / "data"), "HF_HUB_OFFLINE": "1"}
    if chaos is not None:
        env["FLODL_CHAOS"] = chaos
    return subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={tmp / sweep}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_hf_lora_survives_a_lost_rank_resumes_and_refuses_another_base(tmp_path):
    stem = tmp_path / "ckpt" / "run"
    knobs = ["experiment=hf_lora", *SMALL, f"trainer.save_path={stem}"]
    knobs += ["cluster.heartbeat_timeout_s=3"]
    first = run_py(knobs, tmp_path, "first", chaos="1:window:2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((tmp_path / "first" / "0" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["coverage_exact"]
    assert summary["lost_ranks"] == [1]  # rank 1 was killed in its second window; 0 went on
    meta = json.loads(stem.with_suffix(".meta.json").read_text())
    assert meta["epoch"] == 2
    shard = next(stem.parent.glob("run.*.model.pt"))
    blob = torch.load(shard, weights_only=True)
    assert blob["params"] and all(".lora_" in n for n in blob["params"])  # no frozen base
    assert blob["base"] and shard.stat().st_size < 200_000
    hf = tmp_path / "first" / "0" / "hf"
    assert (hf / "adapter" / "adapter_model.safetensors").exists()
    assert (hf / "base" / "model.safetensors").exists() and (
        hf / "adapter" / "tokenizer.json"
    ).exists()

    resumed = run_py(
        [*knobs, f"trainer.resume_from={stem}", "trainer.num_epochs=3"], tmp_path, "resumed"
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "resumed" / "0" / "summary.json").read_text())
    # epochs counts the bundle's two (as the console and the bundle do) and the third trained now
    assert summary["status"] == "ok" and summary["epochs"] == 3
    assert json.loads(stem.with_suffix(".meta.json").read_text())["epoch"] == 3

    other = run_py(
        [*knobs, f"trainer.resume_from={stem}", "trainer.num_epochs=4", "trainer.seed=5",
         f"trainer.save_path={tmp_path / 'ckpt' / 'other'}"],
        tmp_path, "other",
    )  # fmt: skip
    assert other.returncode == 1
    assert "frozen base" in other.stdout + other.stderr
    assert "lost rank" not in other.stdout + other.stderr  # the job's failure, not a lost device


def test_a_missing_model_is_refused_before_any_rank_with_how_to_fetch_it(tmp_path):
    done = run_py(
        ["model=hf", "model.pretrained=/nonexistent/gpt2", "~model.config"], tmp_path, "missing"
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "model.pretrained" in line]
    assert len(errors) == 1 and "huggingface-cli download" in errors[0]
    assert "/nonexistent/gpt2" in errors[0] and "[rank" not in done.stdout + done.stderr
