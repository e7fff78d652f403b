"""cpu_async: the controller's EASGD centre goes into the pending saves at Stop, then is dropped
(the launcher never holds it next to the final weights)."""

from __future__ import annotations

import torch

from flodl import shards
from flodl.config import ElCheConfig, TrainerConfig
from flodl.runtime.controller import Controller
from flodl.runtime.snapshots import Checkpointer


def _controller(tmp_path) -> tuple[Controller, Checkpointer]:
    cfg = TrainerConfig(num_epochs=1, batch_size=10, elche=ElCheConfig(mode="cpu_async"))
    saver = Checkpointer(str(tmp_path / "ck"), None, "hash", 2)
    return Controller(cfg, 2, [1.0, 1.0], has_eval=False, checkpointer=saver), saver


def test_the_centre_is_written_into_every_pending_save_then_dropped(tmp_path) -> None:
    ctl, saver = _controller(tmp_path)
    centre = torch.arange(1000, dtype=torch.float32)
    ctl.aggregator.center = centre.clone()
    saves = [saver.open(3, "epoch", 1, [0, 1], writer=0), saver.open(-1, "final", None, [0, 1], 0)]
    ctl._release_controller_state()
    assert ctl.aggregator.center is None and ctl.aggregator.outer is None
    for save in saves:
        info = save.written[shards.CONTROLLER]
        loaded = shards.load_shard(str(tmp_path / info.file))
        assert torch.equal(loaded["center"], centre)
    assert len({save.written[shards.CONTROLLER].file for save in saves}) == 2  # one per save


def test_nothing_to_release_writes_nothing(tmp_path) -> None:
    ctl, saver = _controller(tmp_path)
    save = saver.open(-1, "final", None, [0, 1], writer=0)
    ctl._release_controller_state()
    assert shards.CONTROLLER not in save.written
    assert not list(tmp_path.glob("ck*"))
