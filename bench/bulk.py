"""Bulk tensors at 120 M parameters: memory of every mode, a cpu_* averaging round against a gloo
all-reduce, and a checkpoint shard against the disk's sequential write speed.

    .venv/bin/python -m bench.bulk                      # all three, writes bench/results/bulk.json
    .venv/bin/python -m bench.bulk --only speed disk    # a subset
    .venv/bin/python -m bench.bulk --params 30000000    # a smaller model (smoke test)

* ``memory``: one isolated run per mode (2-rank CPU rig, 1 epoch of 128 samples, Adam, a final
  bundle saved): the launcher's peak RSS (``ru_maxrss`` of its own process) and the ranks' peak
  (``ru_maxrss`` of its children), against the parameter bytes. ``solo`` trains in the launcher.
* ``speed``: two rank processes on one host; the median of 5 gloo all-reduces of the flat
  parameter vector, and the median of 5 cpu_* rounds through flodl's control channel of each
  kind: through shared memory (what the launcher negotiates with a rank on its host) and over
  loopback TCP (``cluster.shared_memory=false``; a rank on another host). In a round both ranks
  send their snapshot in a Report, the controller sums them as they arrive, both receive the
  Average and load it into their weights; timed on rank 0. All in the same processes,
  interleaved.
* ``disk``: the median of 5 ``flodl.checkpoint.shards.write_shard`` of the vector against 5 plain
sequential
  writes of the same bytes in 64 MiB blocks, both fsync'd, interleaved (the order alternating),
  same directory.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.common import (
    MODES,
    child_main,
    exit_on_sigterm,
    log,
    machine,
    run_isolated,
    write_result,
)

DEFAULT_PARAMS = 120_000_000
REPEATS = 5  # disk: writes of each kind (medians)
WIDTH = 64


# --- the model: parameters in an embedding table, so a step costs memory traffic, not FLOPs ------


def table_model(rows: int, device: Any) -> Any:
    import torch

    class TableNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(WIDTH, 4)
            self.table = torch.nn.Embedding(rows, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            idx = (x.flatten(1)[:, :8].abs() * 1e4).long() % rows
            return self.head(x.flatten(1)) + 0.01 * self.table(idx).sum(1)[:, :4]

    return TableNet().to(device)


def _adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=1e-4)


def _data(split: str) -> Any:
    from flodl.recipes.datasets import synthetic

    return synthetic(split, n_train=128, n_test=64, input_shape=[1, 8, 8], num_classes=4)


def _proc_kb(path: str, key: str) -> int:
    """The ``key:`` line's kB value of a /proc file (0 when it cannot be read)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _hwm_mb(pid: int | str = "self") -> float:
    """A process's peak RSS (VmHWM: reset by exec, unlike ``ru_maxrss``), in MB."""
    return _proc_kb(f"/proc/{pid}/status", "VmHWM:") / 1e3


def _shmem_mb() -> float:
    """The host's shared memory in use (``Shmem`` in /proc/meminfo: /dev/shm among it), MB."""
    return _proc_kb("/proc/meminfo", "Shmem:") * 1.024 / 1e3


class _RankPeaks(threading.Thread):
    """Samples every rank process's VmHWM until told to stop (the kernel keeps the peak), and
    the host's shared memory above what it was at the start (the channels' /dev/shm files)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[int, float] = {}
        self.shmem_base = _shmem_mb()
        self.shmem_peak = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.done.wait(0.2):
            for child in me.children(recursive=True):
                self.peaks[child.pid] = max(self.peaks.get(child.pid, 0.0), _hwm_mb(child.pid))
            self.shmem_peak = max(self.shmem_peak, _shmem_mb() - self.shmem_base)


def plain_one(payload: dict[str, Any]) -> dict[str, Any]:
    """The reference a rank is held to: a plain PyTorch loop (no flodl) over the same model,
    optimizer and batches, in a fresh process with the same imports; its peak RSS."""
    import torch

    import flodl.runtime.rank.loop  # noqa: F401  (the same baseline as a rank)
    from flodl.recipes.steps import classification_step

    torch.manual_seed(0)
    baseline_mb = _hwm_mb()
    model = table_model(payload["params"] // WIDTH, "cpu")
    optimizer = _adam(model.parameters())
    data = _data("train")
    for i in range(4):  # the memory run's steps: 128 samples, batch 32
        batch = [t[i * 32 : (i + 1) * 32] for t in data.tensors]  # a TensorDataset
        optimizer.zero_grad(set_to_none=True)
        classification_step(model, batch).backward()
        optimizer.step()
    return {"status": "ok", "baseline_mb": baseline_mb, "peak_mb": _hwm_mb()}


def _child(payload: dict[str, Any]) -> dict[str, Any]:
    return plain_one(payload) if payload["kind"] == "plain" else memory_one(payload)


def memory_one(payload: dict[str, Any]) -> dict[str, Any]:
    """One run in this (fresh) process: the launcher's and the ranks' peak RSS."""
    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import classification_step

    rows = payload["params"] // WIDTH
    mode = payload["mode"]
    import flodl.runtime.rank.loop  # noqa: F401  (torch and flodl imported: the baseline)

    baseline_mb = _hwm_mb()
    watch = _RankPeaks()
    watch.start()
    with tempfile.TemporaryDirectory(prefix="flodl-bench-bulk-") as tmp:
        model = partial(table_model, rows)
        ranks = 1 if mode == "solo" else 2
        cfg = (
            Trainer.builder(model, _adam, classification_step)
            .batch_size(32)
            .num_epochs(1)
            .elche(ElCheConfig(mode=mode, anchor=2))
            # a generous start: 9 calibration steps of a 120 M Adam model under heavy load
            # took over the default 120 s (a memory benchmark, not one of start-up time)
            .cluster(
                ClusterConfig(
                    kind="cpu_rig", ranks=ranks, speeds=[1.0] * ranks, start_timeout_s=360
                )
            )
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .build_config()
            .with_(save_path=str(Path(tmp) / "ck" / "run"))
        )
        t0 = time.perf_counter()
        handle = Trainer.run(
            model,
            _adam,
            classification_step,
            cfg,
            dataset=partial(_data, "train"),
            job_dir=Path(tmp) / "job",
        )
        handle.join(timeout=payload["timeout_s"])
        wall = time.perf_counter() - t0
        watch.done.set()
        watch.join()
    n = rows * WIDTH + WIDTH * 4 + 4
    return {
        "status": "ok",
        "mode": mode,
        "params": n,
        "param_mb": n * 4 / 1e6,
        "launcher_baseline_mb": baseline_mb,
        "launcher_peak_mb": _hwm_mb(),
        "rank_peak_mb": max(watch.peaks.values(), default=0.0),
        "shmem_peak_mb": watch.shmem_peak,  # the channels' /dev/shm files (other users' too)
        "wall_s": wall,
    }


def memory(params: int, modes: list[str]) -> list[dict[str, Any]]:
    log("memory: the plain PyTorch loop (the reference)")
    plain = run_isolated("bench.bulk", {"kind": "plain", "params": params}, 450)
    log(f"  {plain}")
    rows = [{**plain, "mode": "plain_loop"}]
    for mode in modes:
        log(f"memory: {mode}")
        result = run_isolated(
            "bench.bulk", {"kind": "memory", "mode": mode, "params": params, "timeout_s": 600}, 650
        )
        if result.get("status") == "ok":
            p = result["param_mb"]
            result["launcher_bound_mb"] = 1.5 * p + 300
            result["launcher_within_bound"] = result["launcher_peak_mb"] <= 1.5 * p + 300
            # What the optimizer needs is what a plain PyTorch loop of the same model, Adam and
            # batches peaks at (weights, gradients, 2 moments, and Adam's own step temporaries:
            # measured, not assumed): a rank's peak above it, in weight copies, is flodl's extra.
            # ``rank_over_4p`` is the older count (the peak less 4 copies and the baseline).
            base = result["launcher_baseline_mb"]
            result["rank_over_4p"] = (result["rank_peak_mb"] - base - 4 * p) / p
            # solo trains in the launcher: the launcher is its rank, held to the rank's rule
            trainer_peak = result["launcher_peak_mb"] if mode == "solo" else result["rank_peak_mb"]
            if plain.get("status") == "ok":
                result["plain_loop_peak_mb"] = plain["peak_mb"]
                result["rank_extra_copies"] = (trainer_peak - plain["peak_mb"]) / p
        result.setdefault("mode", mode)
        log(f"  {result}")
        rows.append(result)
    return rows


# --- speed: gloo all-reduce vs one cpu_* round through the control channel ----------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROUNDS = 5  # speed: interleaved repeats of each kind (medians)


def _rank_speed(
    rank: int, n: int, store_port: int, ports: dict[str, int], secret: bytes, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    from flodl.runtime.wire.channel import connect
    from flodl.runtime.wire.messages import Report

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, 2, is_master=rank == 0, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    flat = torch.randn(n)  # the rank's weights: averaged in place, as the worker loads them
    channels = {kind: connect("127.0.0.1", port, secret) for kind, port in ports.items()}
    times: dict[str, list[float]] = {"allreduce_s": []}
    for kind in channels:
        times[f"{kind}_round_s"], times[f"{kind}_upload_s"] = [], []
    for i in range(ROUNDS):  # interleaved: an all-reduce, then a round of each kind
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        times["allreduce_s"].append(time.perf_counter() - t0)
        flat.div_(2)  # an average, as a round gives (not timed: the bare all-reduce is the bar)
        for kind, channel in channels.items():
            dist.barrier()
            t0 = time.perf_counter()
            channel.send(Report(rank, i, 0, ((0, 64),), 2, 64, 1.0, 0.0, 0, snapshot=flat))
            times[f"{kind}_upload_s"].append(time.perf_counter() - t0)  # the launcher has it
            average = channel.recv().flat
            flat.copy_(average)  # as the worker does (state.load), then drops the message
            del average
            times[f"{kind}_round_s"].append(time.perf_counter() - t0)
    dist.barrier()
    if rank == 0:
        shared = {kind: ch.shm is not None for kind, ch in channels.items()}
        out.put({**times, "shared_memory": shared})
    for channel in channels.values():
        channel.close()
    dist.destroy_process_group()


def _controller(listener: Any, secret: bytes, n: int, shared_memory: bool) -> None:
    """As the launcher does it: one reader per rank sums the snapshots as they arrive
    (flodl.runtime.controller.sums), the mean goes back to both ranks at once."""
    from flodl.runtime.controller.sums import SnapshotSums
    from flodl.runtime.wire.channel import Channel
    from flodl.runtime.wire.messages import Average

    channels = []
    for _ in range(2):
        ch = Channel(listener.accept(timeout_s=120))
        ch.authenticate_as_server(secret, shared_memory=shared_memory)
        channels.append(ch)
    sums = SnapshotSums(gamma=1.0)
    sums.n_params = n
    for i in range(ROUNDS):
        readers = [
            threading.Thread(target=ch.recv, kwargs={"route": sums.route}) for ch in channels
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        mean = sums.take(i, [0, 1])
        senders = [threading.Thread(target=ch.send, args=(Average(i, mean),)) for ch in channels]
        for t in senders:  # as the controller does (Outbound.send_each): at once
            t.start()
        for t in senders:
            t.join()
        del mean
    for ch in channels:  # the ranks' acknowledgements and goodbyes
        threading.Thread(target=_drain, args=(ch,), daemon=True).start()


def _drain(channel: Any) -> None:
    try:
        while True:
            channel.recv()
    except (OSError, EOFError, ConnectionError):
        pass


def speed(params: int) -> dict[str, Any]:
    """A cpu_* round through shared memory (one host: what the launcher negotiates) and over
    loopback TCP (``cluster.shared_memory=false``, or a rank on another host), both against a
    gloo all-reduce of the same vector, interleaved, in the same processes."""
    import multiprocessing as mp

    from flodl.runtime.wire.channel import Listener, new_secret

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    secret = new_secret()
    listeners = {"shm": Listener(), "tcp": Listener()}
    for kind, listener in listeners.items():
        threading.Thread(
            target=_controller, args=(listener, secret, params, kind == "shm"), daemon=True
        ).start()
    ports = {kind: listener.port for kind, listener in listeners.items()}
    store_port = _free_port()
    procs = [
        ctx.Process(target=_rank_speed, args=(r, params, store_port, ports, secret, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=900)
    for p in procs:
        p.join(60)
    for listener in listeners.values():
        listener.close()
    reduce_s = statistics.median(result["allreduce_s"])
    summary: dict[str, Any] = {**result, "params": params, "allreduce_median_s": reduce_s}
    for kind in ports:
        round_s = statistics.median(result[f"{kind}_round_s"])
        summary[f"{kind}_round_median_s"] = round_s
        summary[f"{kind}_round_over_allreduce"] = round_s / reduce_s
        # of a round: the snapshot's way up (written, for shm), then the sum and the way back
        summary[f"{kind}_upload_median_s"] = statistics.median(result[f"{kind}_upload_s"])
    return summary


# --- disk: a shard write against a plain sequential write ---------------------------------------


def _plain_write(path: Path, data: memoryview) -> None:
    with open(path, "wb") as f:
        for start in range(0, len(data), 64 << 20):
            f.write(data[start : start + (64 << 20)])
        f.flush()
        os.fsync(f.fileno())


def disk(params: int, where: str) -> dict[str, Any]:
    import torch

    from flodl.checkpoint import shards
    from flodl.runtime.wire.streaming import tensor_view

    flat = torch.randn(params)
    view = tensor_view(flat)
    plain, shard = [], []
    with tempfile.TemporaryDirectory(prefix="flodl-bench-disk-", dir=where) as tmp:

        def plain_once(i: int) -> None:
            target = Path(tmp) / f"plain{i}.bin"
            t0 = time.perf_counter()
            _plain_write(target, view)
            plain.append(time.perf_counter() - t0)
            target.unlink()

        def shard_once(i: int) -> None:
            stem = str(Path(tmp) / f"run{i}")
            t0 = time.perf_counter()
            info = shards.write_shard(stem, shards.new_tag(), "model", {"params": {"w": flat}})
            shard.append(time.perf_counter() - t0)
            (Path(tmp) / info.file).unlink()

        for i in range(REPEATS):  # interleaved, the order alternating: neither always goes first
            for once in (plain_once, shard_once) if i % 2 == 0 else (shard_once, plain_once):
                once(i)
    mb = len(view) / 1e6
    plain_mbs, shard_mbs = mb / statistics.median(plain), mb / statistics.median(shard)
    return {
        "bytes": len(view),
        "dir": where,
        "plain_s": plain,
        "shard_s": shard,
        "plain_mb_per_s": plain_mbs,
        "shard_mb_per_s": shard_mbs,
        "shard_over_plain": shard_mbs / plain_mbs,
    }


def main(argv: list[str]) -> int:
    if child_main(argv, _child):
        return 0
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=DEFAULT_PARAMS)
    ap.add_argument("--only", nargs="*", default=["memory", "speed", "disk"])
    ap.add_argument("--modes", nargs="*", default=["solo", *MODES])
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="bulk")
    args = ap.parse_args(argv)
    result: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join(["python -m bench.bulk", *argv]),
    }
    if "memory" in args.only:  # first: later phases allocate in this (driver) process
        result["memory"] = memory(args.params, args.modes)
    if "disk" in args.only:
        log("disk")
        result["disk"] = disk(args.params, args.disk_dir)
        log(f"  {result['disk']}")
    if "speed" in args.only:
        log("speed")
        result["speed"] = speed(args.params)
        log(f"  {result['speed']}")
    result["load_average_end"] = list(os.getloadavg())
    result["machine"]["load_average_end"] = result["load_average_end"]
    log(f"wrote {write_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
