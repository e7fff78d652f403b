"""The plan-fed loader, placement and adoption, without rank processes (one DataLoader worker)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from flodl.config import ConfigError, LoaderConfig, LoaderOverride, TrainerConfig
from flodl.data.loader import READY, InlinePath, PlannedLoader, adopt, data_path
from flodl.data.residency import place
from flodl.data.source import BatchSource, epoch_permutation


class Indexed(Dataset):
    """Sample i is a dict holding i: batches say exactly which samples were loaded."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((2,), float(i)), "i": torch.tensor(i)}


def _ids(batch: dict) -> list[int]:
    return batch["i"].tolist()


def _expected(n: int, epoch: int, chunks, batch: int) -> list[list[int]]:
    perm = epoch_permutation(n, 0, epoch).tolist()
    out = []
    for offset, size in chunks:
        for s in range(offset, offset + size, batch):
            out.append(perm[s : min(s + batch, offset + size)])
    return out


def _loader(n: int = 64, batch: int = 4, **cfg) -> PlannedLoader:
    source = BatchSource(Indexed(n), batch, 0, torch.device("cpu"))
    path = data_path(source, LoaderConfig(**({"num_workers": 1, "prefetch_factor": 2} | cfg)))
    assert isinstance(path, PlannedLoader)
    return path


def test_planned_windows_load_exactly_the_plan_in_order_and_cancel_drops_a_void_window() -> None:
    loader = _loader()
    try:
        w0 = ((0, 0), 0, ((0, 10),))
        w1 = ((1, 0), 0, ((10, 7), (40, 3)))
        w2 = ((2, 0), 0, ((17, 9),))
        for key, epoch, chunks in (w0, w1, w2):
            loader.feed(key, epoch, chunks)
        got0 = [_ids(b) for b in loader.batches(*w0)]
        loader.cancel(w1[0])  # voided after it was fed: some of it is already in flight
        got2 = [_ids(b) for b in loader.batches(*w2)]
        w3 = ((3, 1), 1, ((0, 12),))  # next epoch, a new generation: a fresh permutation
        got3 = [_ids(b) for b in loader.batches(*w3)]
        iterator = loader._iter
    finally:
        loader.close()
    assert got0 == _expected(64, 0, w0[2], 4)
    assert got2 == _expected(64, 0, w2[2], 4)  # none of w1's samples reached w2
    assert got3 == _expected(64, 1, w3[2], 4)
    handed = [k for k in loader.sampler.handed if k is not None]
    assert not loader.sampler.queued and not handed
    assert iterator is not None and loader.loader is None  # one iterator served every window


def test_a_window_fed_but_never_trained_is_discarded_not_served() -> None:
    loader = _loader()
    try:
        loader.feed((0, 0), 0, ((0, 8),))
        loader.feed((1, 0), 0, ((8, 8),))  # skipped (cooperative queue dropped it)
        got = [_ids(b) for b in loader.batches((2, 0), 0, ((16, 4),))]
    finally:
        loader.close()
    assert got == _expected(64, 0, ((16, 4),), 4)


class Failing(Indexed):
    def __getitem__(self, i: int) -> dict:
        if i == 13:
            raise ValueError("sample 13 is corrupt")
        return super().__getitem__(i)


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_the_receiver_takes_batches_ahead_and_an_idle_loader_does_not_spin_on_fillers() -> None:
    loader = _loader(prefetch_factor=1)  # one worker, one batch in flight
    try:
        loader.feed((0, 0), 0, ((0, 24),))  # 6 batches
        receiver = loader._receiver
        assert receiver is not None
        # Received off the training thread before it asks: READY (2) waiting, one more in the
        # worker, the rest not yet handed out (a rank holds no more than READY extra).
        assert _wait_for(lambda: receiver.ready.full()) and READY == 2
        assert _wait_for(lambda: len(loader.sampler.queued) == 6 - READY - 2)
        got = [_ids(b) for b in loader.batches((0, 0), 0, ((0, 24),))]
        assert got == _expected(64, 0, ((0, 24),), 4)
        assert _wait_for(lambda: not loader.sampler.has_work())
        fillers = loader.sampler.fillers
        _wait_for(lambda: False, timeout_s=0.3)  # idle: nothing planned, nothing in flight
        assert loader.sampler.fillers == fillers <= 1
        later = [_ids(b) for b in loader.batches((1, 0), 0, ((24, 8),))]  # and wakes on a feed
        assert later == _expected(64, 0, ((24, 8),), 4)
    finally:
        loader.close()
    assert not receiver._thread.is_alive()


def test_a_workers_error_reaches_the_training_thread_and_stays() -> None:
    source = BatchSource(Failing(64), 4, 0, torch.device("cpu"))
    loader = data_path(source, LoaderConfig(num_workers=1, prefetch_factor=2))
    perm = epoch_permutation(64, 0, 0).tolist()
    bad = perm.index(13) // 4  # the batch holding sample 13
    try:
        batches = loader.batches((0, 0), 0, ((0, 64),))
        for _ in range(bad):
            next(batches)
        with pytest.raises(ValueError, match="sample 13 is corrupt"):
            next(batches)
        with pytest.raises(ValueError, match="sample 13 is corrupt"):  # not a hang after it
            next(loader.batches((1, 0), 0, ((0, 4),)))
    finally:
        loader.close()


def test_without_persistent_workers_each_window_gets_its_own_loader() -> None:
    loader = _loader(persistent_workers=False)
    got = [_ids(b) for b in loader.batches((0, 0), 2, ((5, 6),))]
    assert got == _expected(64, 2, ((5, 6),), 4)


def test_dict_samples_stay_dicts_inline_and_tensors_stay_tensors() -> None:
    source = BatchSource(Indexed(20), 5, 0, torch.device("cpu"))
    path = data_path(source, LoaderConfig())
    assert isinstance(path, InlinePath)
    batch = next(iter(path.batches((0, 0), 0, ((0, 5),))))
    assert set(batch) == {"x", "i"} and batch["x"].shape == (5, 2)
    plain = BatchSource(Subset(torch.arange(30.0), range(30)), 6, 0, torch.device("cpu"))
    assert next(plain.batches(0, ((0, 6),))).shape == (6,)  # not a list of rows


def test_auto_keeps_tensors_resident_and_streams_other_datasets() -> None:
    cpu = torch.device("cpu")
    tensors = BatchSource(TensorDataset(torch.zeros(8, 2)), 4, 0, cpu)
    assert place(tensors, LoaderConfig(num_workers=2)) and tensors.fast
    assert isinstance(data_path(tensors, LoaderConfig(num_workers=2)), InlinePath)
    streamed = BatchSource(TensorDataset(torch.zeros(8, 2)), 4, 0, cpu)
    assert not place(streamed, LoaderConfig(placement="streaming", num_workers=1))
    assert not streamed.fast  # workers load it sample by sample
    other = BatchSource(Indexed(8), 4, 0, cpu)
    assert not place(other, LoaderConfig()) and not other.fast


def test_explicit_resident_materializes_a_dict_dataset_once() -> None:
    source = BatchSource(Indexed(10), 4, 0, torch.device("cpu"))
    assert place(source, LoaderConfig(placement="resident"))
    batch = next(source.batches(0, ((0, 4),)))
    assert _ids(batch) == epoch_permutation(10, 0, 0)[:4].tolist()
    assert torch.equal(batch["x"][:, 0], batch["i"].float())


def test_resident_over_budget_names_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flodl.data.residency.free_bytes", lambda device: 100)
    source = BatchSource(Indexed(10), 4, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"loader\.placement=resident.*resident_fraction"):
        place(source, LoaderConfig(placement="resident"))


def _collate(samples: list) -> list:
    return [s * 2 for s in samples]


def test_a_dataloader_is_adopted_with_its_workers_and_collate() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    given = DataLoader(data, batch_size=4, shuffle=True, num_workers=2, collate_fn=_collate)
    dataset, loader, collate = adopt(given, LoaderConfig(), 4)
    assert dataset is data and collate is _collate
    assert loader.num_workers == 2 and loader.prefetch_factor == 2
    mine = adopt(given, LoaderConfig(num_workers=1), 4)[1]
    assert mine.num_workers == 1  # .loader(...) wins


def test_refusals_name_the_fix() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 8, 8)
    with pytest.raises(ConfigError, match=r"own sampler.*\.loader\("):
        adopt(DataLoader(data, sampler=weighted), LoaderConfig(), 1)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ConfigError, match=r"IterableDataset without shards.*ShardStream"):
        adopt(Stream(), LoaderConfig(), 1)


def test_per_rank_overrides_and_their_count() -> None:
    from flodl.placement.topology import resolve_topology
    from flodl.preflight import rank_loaders

    cfg = TrainerConfig(
        cluster={"kind": "cpu_rig", "ranks": 2},
        loader={"num_workers": 1, "ranks": [{"placement": "resident"}, {"num_workers": 2}]},
    )
    first, second = rank_loaders(cfg, resolve_topology(cfg, probe_hosts=False))
    assert (first.placement, first.num_workers) == ("resident", 1)
    assert (second.placement, second.num_workers) == ("auto", 2)
    bad = cfg.with_(loader={"ranks": [LoaderOverride()]})
    with pytest.raises(ConfigError, match=r"loader\.ranks: 1 entries but the run has 2"):
        rank_loaders(bad, resolve_topology(bad, probe_hosts=False))
    lone = cfg.with_(loader={"prefetch_factor": 4})
    with pytest.raises(ConfigError, match=r"loader\.prefetch_factor=4"):
        rank_loaders(lone, resolve_topology(lone, probe_hosts=False))


def _write_shards(tmp_path, counts: list[int]) -> list[str]:
    import io
    import tarfile

    paths, i = [], 0
    for s, n in enumerate(counts):
        path = tmp_path / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(n):
                for ext, payload in (("x", str(i).encode()), ("cls", str(i % 3).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
                i += 1
        paths.append(str(path))
    return paths


def _decode(sample: dict) -> dict:
    return {"i": torch.tensor(int(sample["x"])), "y": torch.tensor(int(sample["cls"]))}


def test_tar_shards_load_every_sample_once_grouped_by_shard(tmp_path) -> None:
    from flodl.data.streams import ShardStream

    stream = ShardStream(_write_shards(tmp_path, [5, 7, 4]), decode=_decode)
    assert len(stream) == 16 and stream[6]["i"].item() == 6 and stream[6]["y"].item() == 0
    order = stream.epoch_order(0, 3).tolist()
    assert sorted(order) == list(range(16)) and order == stream.epoch_order(0, 3).tolist()
    shard_of = [next(s for s, (f, n) in enumerate(stream.bounds) if f <= i < f + n) for i in order]
    assert sum(a != b for a, b in itertools.pairwise(shard_of)) == 2  # 3 runs
    source = BatchSource(stream, 4, 0, torch.device("cpu"))
    path = data_path(source, LoaderConfig(num_workers=1))
    try:
        chunks = ((0, 9), (9, 7))  # two windows, as the controller would plan them
        got = [b["i"].tolist() for k, c in enumerate(chunks) for b in path.batches((k, 0), 1, (c,))]
    finally:
        path.close()
    assert sorted(i for b in got for i in b) == list(range(16))
    assert [i for b in got for i in b] == stream.epoch_order(0, 1).tolist()


def test_shards_through_fsspec_urls(tmp_path) -> None:
    pytest.importorskip("fsspec")
    import fsspec

    from flodl.data.streams import ShardStream

    (local,) = _write_shards(tmp_path, [3])
    url = "memory://flodl-test/shard-000.tar"
    with fsspec.open(url, "wb") as fh, open(local, "rb") as src:
        fh.write(src.read())
    stream = ShardStream([url], decode=_decode)
    assert [stream[i]["i"].item() for i in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="non-empty list"):
        ShardStream("one.tar")


def test_a_host_workers_loader_overrides_its_ranks() -> None:
    from flodl.placement.topology import resolve_topology
    from flodl.preflight import rank_loaders

    workers = [
        {"host": "localhost", "devices": "cpu", "ranks": 2, "loader": {"placement": "resident"}},
        {"host": "127.0.0.1", "devices": "cpu", "ranks": 1, "loader": {"num_workers": 3}},
    ]
    cfg = TrainerConfig(cluster={"kind": "hosts", "workers": workers})
    loaders = rank_loaders(cfg, resolve_topology(cfg, probe_hosts=False))
    assert [(c.placement, c.num_workers) for c in loaders] == [
        ("resident", 0),
        ("resident", 0),
        ("auto", 3),
    ]


class _Squares(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i * i)]), i % 2


def test_a_dataset_class_a_factory_or_an_instance_resolve_alike() -> None:
    """``.dataset(MyDataset)``: the class is a factory, as a function is (its instances index;
    the class itself only has the unbound ``__getitem__``)."""
    from flodl.data.source import resolve_dataset

    for given in (_Squares, lambda: _Squares(), _Squares()):
        dataset = resolve_dataset(given)
        assert isinstance(dataset, _Squares) and len(dataset) == 8
