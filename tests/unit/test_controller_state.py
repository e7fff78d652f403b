"""cpu_* with outer=nesterov: the controller's outer state goes into the pending saves at Stop,
then is dropped (the launcher never holds it next to the final weights); plain averaging (EASGD
included: the ranks blend, the controller keeps nothing) has nothing to write."""

from __future__ import annotations

import torch

from flodl.checkpoint import shards
from flodl.config import ElCheConfig, TrainerConfig
from flodl.runtime.controller.controller import Controller
from flodl.runtime.controller.snapshots import Checkpointer
from flodl.runtime.sync.outer import make_outer


def _controller(tmp_path) -> tuple[Controller, Checkpointer]:
    elche = ElCheConfig(mode="cpu_async", outer="nesterov")
    cfg = TrainerConfig(num_epochs=1, batch_size=10, elche=elche)
    saver = Checkpointer(str(tmp_path / "ck"), None, "hash", 2)
    return Controller(cfg, 2, [1.0, 1.0], has_eval=False, checkpointer=saver), saver


def test_the_outer_state_is_written_into_every_pending_save_then_dropped(tmp_path) -> None:
    ctl, saver = _controller(tmp_path)
    previous = torch.arange(1000, dtype=torch.float32)
    outer = make_outer(ctl.cfg.elche, 1000)
    assert outer is not None
    outer.previous, outer.buffer = previous.clone(), torch.ones(1000)
    ctl.aggregator.outer = outer
    saves = [saver.open(3, "epoch", 1, [0, 1], writer=0), saver.open(-1, "final", None, [0, 1], 0)]
    ctl.release_controller_state()
    assert ctl.aggregator.outer is None
    for save in saves:
        info = save.written[shards.CONTROLLER]
        loaded = shards.load_shard(str(tmp_path / info.file))
        assert torch.equal(loaded["outer_previous"], previous)
        assert torch.equal(loaded["outer_buffer"], torch.ones(1000))
        assert "center" not in loaded
    assert len({save.written[shards.CONTROLLER].file for save in saves}) == 2  # one per save


def test_nothing_to_release_writes_nothing(tmp_path) -> None:
    ctl, saver = _controller(tmp_path)
    save = saver.open(-1, "final", None, [0, 1], writer=0)
    ctl.release_controller_state()
    assert shards.CONTROLLER not in save.written
    assert not list(tmp_path.glob("ck*"))
