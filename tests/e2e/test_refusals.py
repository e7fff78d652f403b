"""Bad input through the real run.py: refused in the launcher before any rank starts, exit 2,
one line naming the key, the value and the fix, no traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.light  # refusals start no rank

ROOT = Path(__file__).resolve().parents[2]


def refused(args: list[str], tmp_path: Path) -> tuple[str, float]:
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, (args, out.stdout[-2000:], out.stderr[-2000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not list(sweep.glob("**/rank_*.log")), args  # no rank was started
    assert not list(sweep.glob("**/model.pt"))
    return errors[0], elapsed


def test_factory_arguments_are_bound_and_dry_built_before_any_rank(tmp_path):
    cases = {
        "optimizer.lr=abc": "optimizer.lr=abc: torch.optim.Adam expects float",
        "+model.hiden=3": "model.hiden: unknown argument of recipes.models.MLP (did you mean "
        "model.hidden?)",
        "model.hidden=-1": "refused on a dry build: ValueError: MLP: hidden=-1: must be >= 1",
        "model._target_=tests.e2e.faulty.PretrainedBackbone": (
            "FileNotFoundError: pretrained/backbone.pt: no such file"
        ),
        "trainer.batch_size=5000": "trainer.batch_size=5000: larger than the dataset (4000 "
        "training samples",
    }
    for i, (override, expected) in enumerate(cases.items()):
        line, elapsed = refused([override], tmp_path / str(i))
        assert expected in line, line
        assert elapsed < 60, (override, elapsed)  # no rank start-up; ~3 s on a quiet machine


def test_outputs_are_checked_before_training(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    unwritable = tmp_path / "a_file" / "ckpt" / "run"
    cases = {
        f"trainer.resume_from={tmp_path}/none": f"trainer.resume_from={tmp_path}/none: no "
        "checkpoint",
        f"trainer.save_path={unwritable}": f"trainer.save_path={unwritable}: cannot write",
        "trainer.save_path=''": "trainer.save_path=: empty",
    }
    for i, (override, expected) in enumerate(cases.items()):
        line, _ = refused([override], tmp_path / str(i))
        assert expected in line, line


def test_cluster_and_callback_knobs(tmp_path):
    line, _ = refused(["cluster.controller.port=65535"], tmp_path / "port")
    assert "cluster.controller.port=65535: must be at most 65534" in line
    args = ["trainer.callback_policy.kind=rank", "trainer.callback_policy.rank=2"]
    line, _ = refused(args, tmp_path / "rank")
    assert "trainer.callback_policy.rank=2: this run has 2 rank(s)" in line


def test_datasets_the_controller_cannot_plan_are_refused(tmp_path):
    cases = {
        "dataset._target_=tests.e2e.faulty.StreamOnly": "IterableDataset without shards; the "
        "controller plans which samples each rank trains: give a map-style dataset or "
        "flodl.streams.ShardStream(shards",
        "dataset._target_=tests.e2e.faulty.wrapped_loader": "builds a DataLoader",
        "loader.prefetch_factor=4": "loader.prefetch_factor=4 (rank 0): prefetching needs",
    }
    for i, (override, expected) in enumerate(cases.items()):
        line, _ = refused([override], tmp_path / str(i))
        assert expected in line, line
