"""One faulted run of the chaos matrix, in its own process: prints one JSON line of outcome.

    python -m bench.chaos.run_one --mode nccl_cadence --ranks 3 --faults 1:report:2 [--ckpt DIR]
        [--hosts HOSTS.json]

The faults go into ``FLODL_CHAOS`` (flodl/runtime/wire/chaos.py) before the ranks start, so every
rank inherits them (remote ranks through their role env) and strikes at its own moment. With
``--hosts`` (written by ``matrix --cohort ssh``: fake hosts from tests/netns_hosts.py) the
ranks run on those hosts over ssh — rank 0 on the first, the others on the second — instead
of as local children.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil

from flodl import ClusterBuilder, ClusterConfig, ElCheConfig, LoggerConfig, SshConfig, Trainer
from flodl.recipes.steps import accuracy, classification_step
from tests.integration.helpers import data, is_rank_itself, model_factory, optim_factory

HEARTBEAT_S = 3.0  # small, so a frozen rank is found quickly
START_S = 30.0
ROOT = Path(__file__).resolve().parents[2]
SPEEDS = [1.0, 0.7, 0.5, 0.6]


def local_cluster(ranks: int, start_s: float = START_S) -> ClusterConfig:
    return ClusterConfig(
        kind="cpu_rig",
        ranks=ranks,
        speeds=SPEEDS[:ranks],
        warmup_steps=2,
        heartbeat_timeout_s=HEARTBEAT_S,
        start_timeout_s=start_s,
    )


def ssh_cluster(ranks: int, hosts_file: str) -> ClusterConfig:
    """Rank 0 on the first fake host, ranks 1.. on the second, reached over ssh."""
    hosts = json.loads(Path(hosts_file).read_text())
    builder = ClusterBuilder().controller(hosts["controller_address"])
    for address, speeds in zip(hosts["addresses"], [SPEEDS[:1], SPEEDS[1:ranks]], strict=True):
        builder.worker(
            address,
            devices="cpu",
            ranks=len(speeds),
            speeds=speeds,
            ssh=SshConfig(config_file=hosts["ssh_config"]),
            python=sys.executable,
            project_path=str(ROOT),
            nccl_socket_ifname=hosts["interface"],
            env={"PYTHONPATH": str(ROOT)},  # the ranks unpickle tests.integration.helpers
        )
    start_s = 3 * START_S  # python + torch started over ssh: slow on shared cores
    return builder.options(
        warmup_steps=2, heartbeat_timeout_s=HEARTBEAT_S, start_timeout_s=start_s
    ).build()


class LinkCut:
    """``--cut``: host 1's link down for ``cut_s`` from the first closed epoch (a metrics_fn),
    and when the ranks living there were gone (None: still running when it came back)."""

    def __init__(self, hosts_file: str, cut_s: float) -> None:
        hosts = json.loads(Path(hosts_file).read_text())
        self.ns, self.interface, self.cut_s = hosts["namespaces"][1], hosts["interface"], cut_s
        self.gone_after_s: float | None = None
        self.thread: threading.Thread | None = None

    def __call__(self, metrics) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._cut, daemon=True)
            self.thread.start()

    def _set(self, state: str) -> None:
        cmd = ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.interface, state]
        subprocess.run(cmd, check=True, timeout=10)

    def _ranks_there(self) -> bool:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
        procs = []
        for pid in out.stdout.split():
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(int(pid)))
        return any(is_rank_itself(p) for p in procs)

    def _cut(self) -> None:
        t0 = time.monotonic()
        self._set("down")
        try:
            while self._ranks_there() and time.monotonic() - t0 < self.cut_s:
                time.sleep(0.1)
            if not self._ranks_there():
                self.gone_after_s = round(time.monotonic() - t0, 1)
            time.sleep(max(0.0, self.cut_s - (time.monotonic() - t0)))
        finally:
            self._set("up")

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.cut_s + 15)


def run(args: argparse.Namespace) -> dict:
    os.environ["FLODL_CHAOS"] = args.faults
    if args.hosts:
        cluster = ssh_cluster(args.ranks, args.hosts)
    else:
        cluster = local_cluster(args.ranks, args.start_timeout)
    cfg = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .batch_size(32)
        .num_epochs(args.epochs)
        .elche(ElCheConfig(mode=args.mode))
        .cluster(cluster)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
    )
    if args.ckpt:
        cfg = cfg.with_(save_path=str(Path(args.ckpt) / "run"), checkpoint_every=1)
    cut = LinkCut(args.hosts, args.cut) if args.cut else None
    t0 = time.perf_counter()
    handle = Trainer.run(
        model_factory,
        optim_factory,
        classification_step,
        cfg,
        dataset=partial(data, "train", args.n_train),
        eval_dataset=partial(data, "test"),
        eval_fn=accuracy,
        metrics_fn=cut,
        job_dir=Path(args.job_dir),
    )
    error = ""
    try:
        handle.join(timeout=args.timeout)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    out: dict = {"wall_s": round(time.perf_counter() - t0, 1), "error": error}
    if cut is not None:
        cut.join()
        out["cut_gone_after_s"] = cut.gone_after_s
    try:
        result = handle.result
    except BaseException as exc:
        out.update(status="failed" if error else "no-result", summary_error=error)
        out.setdefault("detail", f"{type(exc).__name__}: {exc}")
        return out
    s = result.summary
    out.update(
        status=s.status,
        summary_error=s.error or "",
        lost_ranks=list(s.lost_ranks),
        coverage_exact=bool(result.coverage_exact),
        samples_seen=s.samples_seen,
        epochs=len(result.epochs),
        has_state=result.state is not None,
    )
    if args.ckpt:
        out["bundle"] = _bundle(Path(args.ckpt) / "run")
    return out


def _bundle(stem: Path) -> str:
    from flodl.checkpoint.bundle import load_bundle

    try:
        _, meta = load_bundle(str(stem))
    except Exception as exc:
        return f"unloadable: {type(exc).__name__}: {exc}"[:200]
    return f"epoch {meta.epoch} ({meta.save_reason})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="nccl_cadence")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--faults", required=True)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=3072)
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--start-timeout", type=float, default=START_S, help="local ranks'")
    parser.add_argument("--hosts", default="", help="fake hosts' JSON: run the ranks over ssh")
    parser.add_argument("--cut", type=float, default=0.0, help="with --hosts: host 1's link down")
    out = run(parser.parse_args())
    print("CHAOS-RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
