"""flodl.checkpoint.bundle: bundle round trips on local paths and fsspec URLs, atomic saves,
refusals."""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from flodl.checkpoint import store
from flodl.checkpoint.bundle import (
    SCHEMA_VERSION,
    BundleMeta,
    CheckpointError,
    bundle_exists,
    check_compatible,
    load_bundle,
    model_signature,
    save_bundle,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_memory_fs():
    yield
    mem = fsspec.filesystem("memory")
    mem.store.clear()
    mem.pseudo_dirs[:] = [""]


def _meta(epoch: int = 1, **kw: Any) -> BundleMeta:
    fields: dict[str, Any] = dict(
        schema_version=SCHEMA_VERSION,
        epoch=epoch,
        global_step=100 * epoch,
        sync_round=10 * epoch,
        world_size=2,
        save_reason="checkpoint",
        elche_state={"anchor": 4, "counts": [3, 5], "phase": "warmup", "trend_history": [0.5]},
        coverage={"epoch": epoch, "n_samples": 1000, "uncovered": [[0, 10], [500, 20]]},
        config_hash="cfg0123",
        signature="sig0123",
        saved_at=1_700_000_000.5 + epoch,
        extra={"note": "hi"},
    )
    fields.update(kw)
    return BundleMeta(**fields)


def _payload(epoch: int = 1) -> dict[str, Any]:
    """Shaped like the controller's bundle; the optimizer/scheduler state dicts are written out
    by hand (building a real optimizer imports torch._dynamo: seconds, for nothing)."""
    model = torch.nn.Linear(4, 3)
    params = OrderedDict((k, v.detach().clone()) for k, v in model.named_parameters())
    adam = {
        "state": {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": p * p}
            for i, p in enumerate(params.values())
        },
        "param_groups": [
            {
                "lr": 1e-3,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "amsgrad": False,
                "foreach": None,
                "maximize": False,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "params": [0, 1],
            }
        ],
    }
    step_lr = {
        "step_size": 2,
        "gamma": 0.1,
        "base_lrs": [1e-3],
        "last_epoch": epoch,
        "_step_count": epoch + 1,
        "_get_lr_called_within_step": False,
        "_last_lr": [1e-3],
    }
    return {
        "epoch_tag": epoch,
        "params": params,
        "buffers": {"running_mean": torch.zeros(3, dtype=torch.float64)},
        "optimizer": {0: adam, 1: adam},
        "scheduler": {0: step_lr, 1: None},
        "rng": {0: torch.get_rng_state(), 1: torch.get_rng_state()},
        "misc": [1, 2.5, "x", None, True, (3, 4), b"raw", torch.Size([2, 3]), torch.float16],
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _stems(tmp_path: Path) -> dict[str, str]:
    return {
        "path": str(tmp_path / "deep" / "dir" / "run1"),
        "file_url": f"file://{tmp_path}/ck/run1",
        "memory": f"memory://ck-{uuid.uuid4().hex[:8]}/run1",
    }


def _files(stem: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(stem)
    parent = path.rsplit("/", 1)[0] or "/"
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(parent, detail=False))


def _pt_path(stem: str, suffix: str = ".pt") -> str:
    return fsspec.core.url_to_fs(stem)[1] + suffix


@pytest.mark.parametrize("kind", ["path", "file_url", "memory"])
def test_round_trip(tmp_path, kind):
    stem = _stems(tmp_path)[kind]
    payload, meta = _payload(3), _meta(3)
    assert not bundle_exists(stem)
    written = save_bundle(stem, payload, meta)
    assert bundle_exists(stem)
    assert _files(stem) == ["run1.meta.json", "run1.pt"]
    got, got_meta = load_bundle(stem)
    _assert_same(payload, got)
    assert got_meta == written
    assert got_meta.source == stem
    # every field the caller set comes back; save fills the integrity fields
    for name in ("epoch", "global_step", "sync_round", "world_size", "save_reason", "coverage"):
        assert getattr(got_meta, name) == getattr(meta, name)
    assert got_meta.elche_state == meta.elche_state and got_meta.extra == meta.extra
    assert (got_meta.config_hash, got_meta.signature) == ("cfg0123", "sig0123")
    assert got_meta.saved_at == meta.saved_at
    assert len(got_meta.pt_sha256) == 64 and got_meta.pt_bytes > 0
    assert got_meta.flodl_version != ""
    assert meta.pt_sha256 == ""  # the caller's object is not modified


def test_relative_path_and_extension_tolerated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_bundle("ckpt/run1.pt", _payload(1), _meta(1))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["run1.meta.json", "run1.pt"]
    assert load_bundle("ckpt/run1")[1].epoch == 1
    assert load_bundle("ckpt/run1.meta.json")[1].epoch == 1


def test_meta_dict_round_trip_and_validation():
    meta = _meta(2, pt_sha256="ab" * 32, pt_bytes=10, flodl_version="0.1.0")
    d = json.loads(json.dumps(meta.to_dict()))
    assert "source" not in d
    assert BundleMeta.from_dict(d) == meta
    assert BundleMeta.from_dict({**d, "future_key": 1}) == meta  # unknown keys are ignored
    with pytest.raises(CheckpointError, match=r"lacks required keys \['epoch'\]"):
        BundleMeta.from_dict({k: v for k, v in d.items() if k != "epoch"})
    with pytest.raises(CheckpointError, match="epoch must be a non-negative integer"):
        BundleMeta.from_dict({**d, "epoch": True})
    with pytest.raises(CheckpointError, match="world_size must be at least 1"):
        BundleMeta.from_dict({**d, "world_size": 0})
    with pytest.raises(CheckpointError, match=r"coverage.uncovered must be a list"):
        BundleMeta.from_dict({**d, "coverage": {"uncovered": [[1, 2, 3]]}})
    with pytest.raises(CheckpointError, match="elche_state must be an object"):
        BundleMeta.from_dict({**d, "elche_state": [1]})
    with pytest.raises(CheckpointError, match="schema_version 99, this flodl reads 1 or 2"):
        BundleMeta.from_dict({**d, "schema_version": 99}, source="x/run1")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        BundleMeta.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["path", "memory"])
def test_second_save_replaces_first(tmp_path, kind):
    stem = _stems(tmp_path)[kind]
    save_bundle(stem, _payload(1), _meta(1))
    save_bundle(stem, _payload(2), _meta(2))
    assert _files(stem) == ["run1.meta.json", "run1.pt"]
    payload, meta = load_bundle(stem)
    assert payload["epoch_tag"] == meta.epoch == 2
    # the latest save wins even when it is "older" by epoch if it replaced the files cleanly
    save_bundle(stem, _payload(1), _meta(1))
    assert load_bundle(stem)[1].epoch == 1


def _truncate(stem: str, suffix: str = ".pt", keep: int = 100) -> None:
    fs, _ = fsspec.core.url_to_fs(stem)
    path = _pt_path(stem, suffix)
    data = fs.cat_file(path)
    with fs.open(path, "wb") as f:
        f.write(data[:keep])


@pytest.mark.parametrize("kind", ["path", "memory"])
def test_truncated_pt_without_fallback_is_refused(tmp_path, kind):
    stem = _stems(tmp_path)[kind]
    save_bundle(stem, _payload(1), _meta(1))
    save_bundle(stem, _payload(2), _meta(2))
    _truncate(stem)
    with pytest.raises(CheckpointError) as err:
        load_bundle(stem)
    msg = str(err.value)
    assert f"checkpoint {stem}.pt is corrupt or truncated" in msg
    assert "no complete bundle was found" in msg and "\n" not in msg


def test_flipped_byte_is_a_sha_mismatch(tmp_path):
    stem = str(tmp_path / "run1")
    save_bundle(stem, _payload(1), _meta(1))
    data = bytearray(Path(stem + ".pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(stem + ".pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt or truncated \(sha256 mismatch"):
        load_bundle(stem)


@pytest.mark.parametrize("kind", ["path", "memory"])
def test_truncated_pt_falls_back_to_previous_pair(tmp_path, kind, caplog):
    stem = _stems(tmp_path)[kind]
    save_bundle(stem, _payload(1), _meta(1))
    save_bundle(stem, _payload(2), _meta(2), keep_previous=True)
    assert _files(stem) == [
        "run1.meta.json",
        "run1.prev.meta.json",
        "run1.prev.pt",
        "run1.pt",
    ]
    _truncate(stem)
    with pytest.raises(CheckpointError, match=r"newest bundle \(epoch 2\).*\(epoch 1, step"):
        load_bundle(stem)  # falling back is an error unless asked for
    with caplog.at_level(logging.WARNING, logger="flodl.checkpoint.bundle"):
        payload, meta = load_bundle(stem, fallback=True)
    assert payload["epoch_tag"] == meta.epoch == 1
    assert f"checkpoint {stem}.pt is corrupt or truncated" in caplog.text
    assert f"the last good one is {stem}.prev.pt" in caplog.text


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'{"epoch": 1}'])
def test_garbage_meta_is_refused(tmp_path, content):
    stem = str(tmp_path / "run1")
    save_bundle(stem, _payload(1), _meta(1))
    Path(stem + ".meta.json").write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_bundle(stem)
    msg = str(err.value)
    assert f"checkpoint meta {stem}.meta.json" in msg and "\n" not in msg
    assert not bundle_exists(stem)


def test_unknown_schema_version_is_refused(tmp_path):
    stem = str(tmp_path / "run1")
    save_bundle(stem, _payload(1), _meta(1))
    meta_path = Path(stem + ".meta.json")
    d = json.loads(meta_path.read_text())
    d["schema_version"] = 7
    meta_path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="schema_version 7, this flodl reads 1"):
        load_bundle(stem)
    with pytest.raises(CheckpointError, match="writes 1"):
        save_bundle(stem, _payload(1), _meta(1, schema_version=7))


def test_missing_bundle(tmp_path):
    stem = str(tmp_path / "nowhere" / "run1")
    with pytest.raises(
        CheckpointError, match="^" + re.escape(f"no checkpoint at {stem}.meta.json")
    ):
        load_bundle(stem)
    with pytest.raises(
        CheckpointError, match=re.escape("no checkpoint at memory://nope/run1.meta.json")
    ):
        load_bundle("memory://nope/run1")
    assert not bundle_exists(stem)
    # a .pt without its meta is not a bundle, and the message says so
    save_bundle(stem, _payload(1), _meta(1))
    os.unlink(stem + ".meta.json")
    with pytest.raises(CheckpointError, match=r"found .*run1\.pt without its meta\.json"):
        load_bundle(stem)


def test_matching_pt_that_torch_refuses(tmp_path):
    """A .pt whose hash matches but which weights_only cannot read is refused, not unpickled."""
    stem = str(tmp_path / "run1")
    save_bundle(stem, _payload(1), _meta(1))
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save({"x": np.zeros(3)}, buf)
    data = buf.getvalue()
    Path(stem + ".pt").write_bytes(data)
    meta_path = Path(stem + ".meta.json")
    d = json.loads(meta_path.read_text())
    d.update(pt_sha256=hashlib.sha256(data).hexdigest(), pt_bytes=len(data))
    meta_path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"cannot be loaded with torch.load\(weights_only"):
        load_bundle(stem)


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ({"x": np.zeros(3)}, "payload['x'] is a numpy.ndarray"),
        ({"opt": {0: {"lr": np.float64(0.1)}}}, "payload['opt'][0]['lr'] is a numpy.float64"),
        ({"f": [1, lambda: 0]}, "payload['f'][1] is a function"),
        ({"k": {object(): 1}}, "payload['k'] has a key of type object"),
    ],
)
def test_unloadable_payload_refused_at_save(tmp_path, bad, where):
    stem = str(tmp_path / "run1")
    with pytest.raises(CheckpointError) as err:
        save_bundle(stem, bad, _meta(1))
    assert where in str(err.value) and f"cannot save checkpoint {stem}.pt" in str(err.value)
    assert not (tmp_path / "run1.pt").exists() and not list(tmp_path.iterdir())


def test_bad_stems():
    with pytest.raises(CheckpointError, match="non-empty"):
        load_bundle("")
    with pytest.raises(CheckpointError, match="names a directory"):
        save_bundle("ckpt/", _payload(1), _meta(1))
    with pytest.raises(CheckpointError, match="reserves"):
        save_bundle("ckpt/run1.prev", _payload(1), _meta(1))


def test_check_compatible():
    meta = _meta(1, world_size=3, signature="aaaa", source="ckpt/run1")
    check_compatible(meta, signature="aaaa", world_size=3)
    with pytest.raises(CheckpointError) as err:
        check_compatible(meta, signature="bbbb", world_size=3)
    assert str(err.value) == (
        "checkpoint ckpt/run1 was saved for another model (signature aaaa != bbbb); "
        "point trainer.resume_from at a bundle of this model"
    )
    with pytest.raises(CheckpointError) as err:
        check_compatible(meta, signature="aaaa", world_size=2)
    assert str(err.value) == (
        "checkpoint ckpt/run1 was saved by 3 ranks, this run has 2: resume with the same "
        "cluster size (cluster.ranks=3) or start fresh"
    )


def test_model_signature():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    assert model_signature(a) == model_signature(b) == model_signature(b.state_dict())
    assert model_signature(a) != model_signature(torch.nn.Linear(4, 2))
    assert model_signature(a) != model_signature(a.to(torch.float64))


class _Crash(BaseException):
    """Stands in for SIGKILL: not an Exception, so save_bundle does no clean-up."""


_STEPS = ["tmp_pt", "tmp_meta", "park_pt", "park_meta", "commit_pt", "commit_meta", "cleanup"]


@pytest.mark.parametrize("kind", ["path", "memory"])
@pytest.mark.parametrize("step", _STEPS)
def test_interrupted_save_at_every_step(tmp_path, monkeypatch, kind, step):
    stem = _stems(tmp_path)[kind]
    save_bundle(stem, _payload(1), _meta(1))

    def crash(name: str) -> None:
        if name == step:
            raise _Crash(name)

    monkeypatch.setattr(store, "_step_hook", crash)
    with pytest.raises(_Crash):
        save_bundle(stem, _payload(2), _meta(2))
    payload, meta = load_bundle(stem)
    # before the new pair is complete the old one stands; from then on the new one is found
    assert meta.epoch == (1 if step == "tmp_pt" else 2)
    assert payload["epoch_tag"] == meta.epoch
    monkeypatch.setattr(store, "_step_hook", None)
    save_bundle(stem, _payload(3), _meta(3))  # the next save clears every leftover
    assert _files(stem) == ["run1.meta.json", "run1.pt"]
    assert load_bundle(stem)[0]["epoch_tag"] == 3


def test_failed_write_leaves_old_bundle(tmp_path, monkeypatch):
    stem = str(tmp_path / "run1")
    save_bundle(stem, _payload(1), _meta(1))

    def disk_full(name: str) -> None:
        if name == "tmp_pt":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_step_hook", disk_full)
    with pytest.raises(CheckpointError, match=r"No space left on device.*untouched"):
        save_bundle(stem, _payload(2), _meta(2))
    assert sorted(os.listdir(tmp_path)) == ["run1.meta.json", "run1.pt"]
    assert load_bundle(stem)[1].epoch == 1


# -- SIGKILL at random moments ---------------------------------------------------------------------

# A zygote imports torch once (seconds here) and forks a fresh saver process per round; each saver
# resumes from the newest bundle it can load and saves epoch+1, epoch+2, ... with 2-5 MB payloads.
_ZYGOTE = r"""
import os, sys, time
import torch
from flodl.checkpoint.bundle import (
        SCHEMA_VERSION,
        BundleMeta,
        CheckpointError,
        load_bundle,
        save_bundle,
    )

stem = sys.argv[1]

def out(line):
    os.write(1, (line + "\n").encode())

def saver():
    torch.set_num_threads(1)
    try:
        epoch = load_bundle(stem)[1].epoch + 1
    except CheckpointError:
        epoch = 1
    gen = torch.Generator().manual_seed(os.getpid())
    out(f"start {epoch}")
    while True:
        n = int(torch.randint(500_000, 1_250_000, (1,), generator=gen))
        payload = {"epoch_tag": epoch, "w": torch.full((n,), float(epoch))}
        meta = BundleMeta(
            schema_version=SCHEMA_VERSION, epoch=epoch, global_step=10 * epoch,
            sync_round=epoch, world_size=1, save_reason="checkpoint", elche_state=None,
            coverage={}, config_hash="c", signature="s", saved_at=time.time(), extra={"n": n},
        )
        save_bundle(stem, payload, meta)
        out(f"saved {epoch}")
        epoch += 1

while sys.stdin.readline().strip() == "fork":
    pid = os.fork()
    if pid == 0:
        try:
            saver()
        finally:
            os._exit(1)
    out(f"pid {pid}")
    os.waitpid(pid, 0)
    out("reaped")
"""


@pytest.mark.slow
def test_sigkill_during_saves_never_loses_the_last_bundle(tmp_path):
    stem = str(tmp_path / "ck" / "run1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    err_log = open(tmp_path / "zygote.err", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, stem],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err_log,
        env=env,
        cwd=str(tmp_path),
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.put(raw.decode().strip())
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def next_line(timeout: float) -> str:
        line = lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"saver died: {(tmp_path / 'zygote.err').read_text()[-2000:]}")
        return line

    rng = random.Random(1234)
    child = None
    last_epoch = 0
    try:
        for round_no in range(10):
            assert proc.stdin is not None
            proc.stdin.write(b"fork\n")
            proc.stdin.flush()
            child, start, saved = None, None, []
            while child is None or start is None:  # "pid" and "start" may come in either order
                word, value = next_line(120 if round_no == 0 else 30).split()
                if word == "pid":
                    child = int(value)
                elif word == "start":
                    start = int(value)
                elif word == "saved":
                    saved.append(int(value))
            assert start == last_epoch + 1
            if round_no == 0:  # nothing to load before the first save completes
                while not saved:
                    word, value = next_line(30).split()
                    if word == "saved":
                        saved.append(int(value))
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(child, signal.SIGKILL)
            while (line := next_line(30)) != "reaped":
                word, value = line.split()
                if word == "saved":
                    saved.append(int(value))
            child = None
            payload, meta = load_bundle(stem)
            assert payload["epoch_tag"] == meta.epoch
            assert payload["w"].numel() == meta.extra["n"]
            assert bool((payload["w"] == float(meta.epoch)).all())
            assert meta.epoch >= last_epoch, "the loaded epoch went backwards"
            if saved:  # a save that returned is never lost
                assert meta.epoch >= max(saved)
            last_epoch = meta.epoch
        assert last_epoch >= 2
        assert len(os.listdir(tmp_path / "ck")) <= 6  # pair, parked pair, one torn temp pair
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err_log.close()
