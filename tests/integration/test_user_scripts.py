"""A user's own script: closures as factories (serialised), and the cooperative tier
(re-executed per rank, torchrun-style). Both run as real scripts in a subprocess."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import sys
from functools import partial
import torch
from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.datasets import synthetic
from flodl.recipes.models import MLP
from flodl.recipes.steps import accuracy, classification_step

data = partial(synthetic, n_train=1024, n_test=256, input_shape=[1, 8, 8], num_classes=4)
"""


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_closures_from_main_reach_the_ranks(tmp_path):
    out = run_script(
        tmp_path,
        """
        hidden = 24                                   # captured by the closure below
        def make_model(device):
            return MLP([1, 8, 8], 4, hidden=hidden).to(device)
        scale = 3.0
        def step(model, batch):                       # a __main__ function with a global
            x, y = batch
            return torch.nn.functional.cross_entropy(model(x) * scale / 3.0, y)
        if __name__ == "__main__":
            handle = (Trainer.builder(make_model, lambda p: torch.optim.Adam(p, 1e-2), step)
                .dataset(lambda: data("train")).eval_dataset(lambda: data("test"))
                .eval_fn(accuracy).batch_size(32).num_epochs(2)
                .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=2))
                .logger(LoggerConfig(progress="off", tensorboard=False))
                .output_dir("out").run())
            state = handle.join()
            print("RESULT", handle.world_size, state.params["net.1.weight"].shape[0],
                  round(handle.result.summary.eval_value, 3))
        """,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    _, world, hidden, acc = line.split()
    assert (world, hidden) == ("2", "24")
    assert float(acc) > 0.8
    assert out.stdout.count("RESULT") == 1  # nothing re-executed the script


def test_cooperative_tier_reexecutes_per_rank(tmp_path):
    out = run_script(
        tmp_path,
        """
        def make_model(device):
            return MLP([1, 8, 8], 4, hidden=24).to(device)
        print("PRELUDE-RUN", flush=True)
        worker = (Trainer.builder(make_model, lambda p: torch.optim.Adam(p, 1e-2),
                                  classification_step)
            .dataset(lambda: data("train")).eval_dataset(lambda: data("test"))
            .eval_fn(accuracy).batch_size(32).num_epochs(2)
            .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=2))
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir("out").into_worker())
        batches = 0
        for epoch in worker.epochs():
            for batch in worker.batches():
                worker.optimizer.zero_grad()
                loss = classification_step(worker.model, batch)
                loss.backward()
                worker.optimizer.step()
                worker.step(loss)
                batches += 1
        print(f"BATCHES {worker.rank} {batches}", flush=True)
        state = worker.finish()
        print("RESULT", type(state).__name__, len(state.params))
        """,
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert out.stdout.count("RESULT TrainedState") == 1  # after finish(): the launcher only
    console = out.stdout + out.stderr
    counts = {}
    for line in console.splitlines():
        if "BATCHES" in line:
            rank, n = line.split("BATCHES ")[1].split()[:2]
            counts[int(rank)] = int(n)
    assert set(counts) == {-1, 0, 1}  # the launcher's view trains nothing
    assert counts[-1] == 0
    assert counts[0] + counts[1] == 2 * 1024 // 32
    assert counts[0] > counts[1]  # the fast rank did more: cadence is the controller's
    assert console.count("PRELUDE-RUN") == 3  # launcher + 2 re-executed ranks


def test_cooperative_tier_in_process(tmp_path):
    import torch

    from flodl import ClusterConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import accuracy, classification_step

    from .helpers import data, model_factory, optim_factory

    worker = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(lambda: data("train", 640))
        .eval_dataset(lambda: data("test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(2)
        .cluster(ClusterConfig(kind="cpu_rig", ranks=1))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path)
        .into_worker()
    )
    seen = []
    for epoch in worker.epochs():
        for batch in worker.batches():
            worker.optimizer.zero_grad()
            loss = classification_step(worker.model, batch)
            loss.backward()
            worker.optimizer.step()
            worker.step(loss)
            seen.append(epoch)
    state = worker.finish()
    assert seen == [1] * 20 + [2] * 20  # epochs count from 1, as everywhere
    model = state.load_into(model_factory(torch.device("cpu")))
    x, y = data("test").tensors
    assert accuracy(model, x, y) > 0.8
