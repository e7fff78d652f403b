"""The same job through flodl's Python API: save every epoch, then resume from the bundle.

python train_api.py OUT_DIR
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from myproj.data import blobs
from myproj.models import TinyNet
from myproj.steps import train_step

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer


def model_factory(device):
    return TinyNet(features=16, num_classes=4).to(device)


def optim_factory(params):
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def run(out: Path, epochs: int, resume: bool) -> list[int]:
    builder = (
        Trainer.builder(model_factory, optim_factory, train_step)
        .dataset(partial(blobs, "train"))
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig.cpu_sync())
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 1.0]))
        .logger(LoggerConfig(progress="lines", tensorboard=False))
        .output_dir(out / f"run{epochs}")
        .save_path(out / "ckpt" / "tiny")
        .checkpoint_every(1)
    )
    if resume:
        builder = builder.resume_from(out / "ckpt" / "tiny")
    handle = builder.run()
    handle.join(timeout=300)
    return [m.epoch for m in handle.result.epochs]


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "api_out")
    first = run(out, 1, resume=False)
    second = run(out, 2, resume=True)
    print(f"epochs trained: first run {first}, resumed run {second}")
    sys.exit(0 if (first, second) == ([1], [2]) else 1)
