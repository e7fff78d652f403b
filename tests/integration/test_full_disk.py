"""A job directory on a full filesystem (issue 41, item 2), real ranks: training is not stopped
by its loggers, the final bundle (on a disk with room) is written, and the job fails saying
"no space left on <path>" instead of leaving a 0-byte summary.json, a cut model.pt and exit 0."""

from __future__ import annotations

import json
from functools import partial

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.steps import classification_step
from flodl.runtime.controller.snapshots import ResumePoint

from .helpers import data, model_factory, optim_factory

pytestmark = pytest.mark.slow


def test_a_full_job_dir_fails_the_job_loudly_and_keeps_the_bundle(tmp_path, tiny_tmpfs):
    disk = tiny_tmpfs("256k")
    (disk / "ballast").write_bytes(b"\0" * (256 - 20) * 1024)  # ~20 KiB left
    job = disk / "job"
    stem = str(tmp_path / "ckpt" / "run")  # save_path has room
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(3)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="lines", tensorboard=True, csv=True))
    )
    cfg = builder.build_config().with_(save_path=stem, checkpoint_every=1)
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", 768),
        job_dir=job,
    )
    with pytest.raises(OSError, match=rf"no space left on {job}/(model\.pt|summary\.json)"):
        handle.join(timeout=240)
    summary = job / "summary.json"
    if summary.exists():  # never a 0-byte or cut summary; if one was written, it failed
        assert json.loads(summary.read_text())["status"] == "failed"
    assert not (job / "model.pt").exists() or (job / "model.pt").stat().st_size > 0
    assert [p.name for p in job.glob("*.tmp-*")] == []
    point = ResumePoint.load(stem)  # training ran to the end: the final bundle is there
    assert point.meta.epoch == 3 and point.meta.save_reason == "final"
