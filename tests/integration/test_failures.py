"""Bad factories fail fast, once, with the rank's own message, and leave no process behind."""

from __future__ import annotations

import pytest
import torch

from flodl.runtime.controller import RunFailed
from recipes.models import MLP

from .helpers import CLASSES, SHAPE, small_run

pytestmark = pytest.mark.slow


def exploding_factory(device):
    import os

    if os.environ.get("FLODL_RANK") == "1":
        raise ValueError("boom: cannot build on this rank")
    return MLP(SHAPE, CLASSES, hidden=32).to(device)


def uneven_factory(device):
    import os

    hidden = 32 if os.environ.get("FLODL_RANK") == "0" else 48
    return MLP(SHAPE, CLASSES, hidden=hidden).to(device)


def test_factory_error_is_reported_with_the_rank_message(tmp_path):
    with pytest.raises(RunFailed, match=r"rank 1 failed: ValueError: boom: cannot build"):
        small_run(tmp_path, "nccl_cadence", model=exploding_factory)
    summary = (tmp_path / "nccl_cadence" / "summary.json").read_text()
    assert '"status": "failed"' in summary and "boom" in summary


def test_different_architectures_are_refused(tmp_path):
    with pytest.raises(RunFailed, match="different model architectures"):
        small_run(tmp_path, "nccl_cadence", model=uneven_factory)


def test_in_process_factory_error_surfaces(tmp_path):
    def broken(device: torch.device):
        raise RuntimeError("no model for you")

    with pytest.raises(RuntimeError, match="no model for you"):
        small_run(tmp_path, "solo", ranks=1, model=broken)
