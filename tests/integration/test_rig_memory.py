"""Jobs under the rig's simulated device memory (``cluster.memory_mb``): a rank that fits
reports its simulated peak; one that does not fails as a GPU out of memory does, naming the
rank and its budget; torch DDP under the same budget fails where it must."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import classification_step
from flodl.runtime.controller.events import RunFailed
from tests.integration.helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow

# The helpers' data (1,536 samples of 64 floats) lives on the device (resident placement, where
# it fits half the free budget, as on a GPU): 0.38 MiB, more than the model's whole training
# state (~40 KB).
RESIDENT_MIB = 1536 * 64 * 4 / 2**20


def _run(tmp_path, memory_mb, mode="nccl_cadence", placement="auto"):
    return (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .loader(placement=placement)
        .dataset(partial(data, "train", 1536))
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode=mode))
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3, memory_mb=memory_mb
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "job")
        .run()
    )


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_ranks_that_fit_report_their_simulated_peak(tmp_path, mode):
    handle = _run(tmp_path, [100, 2], mode)
    handle.join(timeout=180)
    summary = handle.result.summary
    assert summary.status == "ok" and handle.result.coverage_exact
    for t in summary.telemetry:  # the simulated device's peak, not the process's RSS
        assert RESIDENT_MIB < t["peak_mem_mb"] < 2


def test_data_that_does_not_fit_half_the_free_budget_stays_on_the_host(tmp_path):
    """placement=auto on the rig decides as on a GPU: resident on the big rank, streamed (only
    its batches count) on the one whose free budget is under twice the data."""
    handle = _run(tmp_path, [100, 0.6])
    handle.join(timeout=180)
    summary = handle.result.summary
    assert summary.status == "ok" and handle.result.coverage_exact
    big, small = (t["peak_mem_mb"] for t in summary.telemetry)
    assert big > RESIDENT_MIB > small > 0


def test_a_rank_over_its_budget_fails_like_a_gpu_out_of_memory(tmp_path):
    handle = _run(tmp_path, [100, 0.2], placement="resident")  # 0.38 MiB of data on 0.2
    with pytest.raises(RunFailed, match=r"rank 1 .*OutOfMemoryError: rank 1 out of memory .*0\.2"):
        handle.join(timeout=180)
    assert handle.summary is not None and handle.summary.status == "failed"


_DDP = """
import sys, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from flodl.rig.device_memory import DeviceMemory, MiB, training_state
rank, budget_mb = int(sys.argv[1]), float(sys.argv[3])
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)))
opt = torch.optim.Adam(model.parameters())
memory = DeviceMemory(int(budget_mb * MiB), name=f"ddp rank {rank}")
memory.adopt(training_state(model, opt))
x, y = torch.randn(16, 512), torch.randint(0, 10, (16,))
with memory:
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
print("peak", memory.peak / MiB)
"""


def test_torch_ddp_under_the_same_budget_fails_where_it_must():
    """DDP's training state (weights, gradients, Adam's two moments, its bucket) does not fit
    4 x the weights: out of memory on every rank; at 10 x it trains."""
    weights_mib = (512 * 1024 + 1024 + 1024 * 10 + 10) * 4 / 2**20
    outcomes = {}
    for factor in (4, 10):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-c", _DDP]
            rdv = f"file://{Path(tmp) / 'rdv'}"
            procs = [
                subprocess.Popen(
                    [*cmd, str(r), rdv, str(factor * weights_mib)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r in (0, 1)
            ]
            try:
                outcomes[factor] = [(*p.communicate(timeout=120), p.returncode) for p in procs]
            finally:
                for p in procs:
                    p.kill()
    for _, err, code in outcomes[4]:
        assert code != 0 and "OutOfMemoryError: ddp rank" in err
    for out, _, code in outcomes[10]:
        assert code == 0 and 4 * weights_mib < float(out.split()[-1]) < 10 * weights_mib
