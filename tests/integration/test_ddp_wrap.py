"""Ddp.wrap, the bypass tier: real 2-rank process groups over gloo on loopback.

Each distributed test starts two rank subprocesses that run one scenario below and save what
they saw; the assertions run here, against single-process references.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from flodl.ddp import Ddp, Rendezvous

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
WORLD = 2
RANK_TIMEOUT_S = 20.0  # a rank stuck in a collective gives up after this
CHILD_DEADLINE_S = 120.0  # all scenarios, one start-up
ROOT = Path(__file__).resolve().parents[2]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 GPUs"),
    ),
]


# -- shared data and models (deterministic, so parent and ranks agree) ---------------------------
def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def _linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(5, 3)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().cpu().clone()
        for n, p in model.named_parameters()
    }


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return _grads(model)


# -- scenarios: each runs on every rank and returns what the parent checks -----------------------
def scenario_sync_params(rank: int, rdv: Rendezvous, device: str) -> dict:
    torch.manual_seed(100 + rank)  # different weights on each rank
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).to(device)
    for _ in range(rank + 1):  # different BatchNorm stats and step counters too
        model(torch.randn(6, 5, device=device))
    before = _state(model)
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.sync_params()
        from_0 = _state(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank + 1.0)
        shifted = _state(model)
        ddp.sync_params(src=1)
        from_1 = _state(model)
    return {"before": before, "from_0": from_0, "shifted": shifted, "from_1": from_1}


def scenario_all_reduce(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _linear().to(device)
    x, y = _data(8)
    shard = slice(4 * rank, 4 * rank + 4)
    F.mse_loss(model(x[shard].to(device)), y[shard].to(device)).backward()
    local = _grads(model)
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.all_reduce_gradients()
    return {"local": local, "synced": _grads(model)}


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.unused, self.frozen = (nn.Linear(3, 1) for _ in range(4))
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x) + self.frozen(x)
        return out + self.b(x) if use_b else out


def scenario_missing_grads(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _Branches().to(device)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)).to(device)
    model(x, use_b=rank == 1).sum().backward()  # b has a grad on rank 1 only
    local = _grads(model)
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.all_reduce_gradients()
    return {"local": local, "synced": _grads(model)}


def scenario_weighted(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _linear().to(device)
    x, y = _data(16)
    for batch in [(0, 1, 2), (3,)][rank]:  # counts [3, 1]: plain accumulation, not divided
        part = slice(4 * batch, 4 * batch + 4)
        F.mse_loss(model(x[part].to(device)), y[part].to(device)).backward()
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.weighted_all_reduce_gradients([3, 1])
    return {"synced": _grads(model)}


def scenario_weighted_zero(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _linear().to(device)
    x, y = _data(8)
    if rank == 0:  # counts [0, 2]: whatever rank 0 holds must not leak in
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))
    else:
        for batch in (0, 1):
            part = slice(4 * batch, 4 * batch + 4)
            F.mse_loss(model(x[part].to(device)), y[part].to(device)).backward()
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.weighted_all_reduce_gradients([0, 2])
    return {"synced": _grads(model)}


def scenario_sync_buffers(rank: int, rdv: Rendezvous, device: str) -> dict:
    torch.manual_seed(0)
    model = nn.BatchNorm1d(4).to(device)
    g = torch.Generator().manual_seed(rank)
    for _ in range(rank + 1):
        model(torch.randn(8, 4, generator=g).mul(rank + 1).to(device))
    before = _state(model)
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.sync_buffers()
    return {"before": before, "after": _state(model)}


def scenario_average_params(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _linear(seed=10 + rank).to(device)
    before = _state(model)
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        divergence = ddp.average_params()
        equal = _state(model)
        with torch.no_grad():
            model.weight.add_(rank)
        shifted = _state(model)
        ddp.average_params(weight=[0.75, 0.25][rank])
    return {
        "before": before,
        "equal": equal,
        "divergence": divergence,
        "shifted": shifted,
        "weighted": _state(model),
    }


def scenario_training(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = _mlp(seed=rank).to(device)  # replicas start apart; sync_params joins them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with Ddp.wrap(model, device, rank, rdv) as ddp:
        ddp.sync_params()
        for step in range(6):
            x, y = _data(8, seed=step)
            shard = slice(4 * rank, 4 * rank + 4)
            loss = F.mse_loss(model(x[shard].to(device)), y[shard].to(device))
            loss.backward()
            ddp.all_reduce_gradients()
            ddp.sync_buffers()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"final": _state(model), "losses": torch.tensor(losses)}


def scenario_reuse_group(rank: int, rdv: Rendezvous, device: str) -> dict:
    store = dist.TCPStore(rdv.host, rdv.port, is_master=False, use_libuv=False)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=WORLD)
    try:
        try:
            Ddp.wrap(_linear().to(device), device, 1 - rank, rdv)
            wrong_rank = ""
        except ValueError as exc:
            wrong_rank = str(exc)
        with Ddp.wrap(_linear().to(device), device, rank, rdv) as ddp:
            ddp.sync_params()
        still_up = dist.is_initialized()
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)  # the group the caller built still works
        return {"wrong_rank": wrong_rank, "still_up": still_up, "probe": probe.cpu()}
    finally:
        dist.destroy_process_group()


def scenario_mismatched_models(rank: int, rdv: Rendezvous, device: str) -> dict:
    model = nn.Linear(5, 3 + rank).to(device)
    try:
        Ddp.wrap(model, device, rank, rdv)
        message = ""
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "group_left": dist.is_initialized()}


SCENARIOS: dict[str, Callable[[int, Rendezvous, str], dict]] = {
    name.removeprefix("scenario_"): fn
    for name, fn in list(globals().items())
    if name.startswith("scenario_")
}


#: Scenarios whose store rank 0 serves (``is_host=True``); the parent serves the others' stores.
RANK0_HOSTS = {"training"}


def child_main() -> None:
    """A rank process; argv: ``rank device out_dir name:port:host_rank ...``.

    Runs every scenario in turn, each on its own store (a fresh process group per scenario), and
    saves ``{name: result}``; a failing scenario records its traceback and the next one runs.
    """
    rank_s, device, out, *specs = sys.argv[1:]
    rank = int(rank_s)
    torch.set_num_threads(1)
    if device == "cuda":
        device = f"cuda:{rank}"
    results: dict[str, dict] = {}
    for spec in specs:
        name, port, host_rank = spec.split(":")
        rdv = Rendezvous.tcp(HOST, int(port), WORLD, rank == int(host_rank), RANK_TIMEOUT_S)
        try:
            results[name] = SCENARIOS[name](rank, rdv, device)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            if dist.is_initialized():
                dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


# -- the parent side -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _run_all(tmp_path: Path, device: str) -> dict[str, list[dict]]:
    """Run every scenario on WORLD rank processes (one start-up for all: importing torch is the
    slow part); returns ``{name: [result of rank 0, result of rank 1]}``."""
    stores, specs = [], []
    for name in SCENARIOS:
        if name in RANK0_HOSTS:
            specs.append(f"{name}:{_free_port()}:0")
        else:
            store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=False)
            stores.append(store)
            specs.append(f"{name}:{store.port}:-1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = f"from {__name__} import child_main; child_main()"
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(WORLD):
            with open(tmp_path / f"rank{rank}.log", "wb") as log:
                cmd = [sys.executable, "-c", code, str(rank), device, str(tmp_path), *specs]
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                )
        deadline = time.monotonic() + CHILD_DEADLINE_S
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        stores.clear()
    for rank, proc in enumerate(procs):
        text = (tmp_path / f"rank{rank}.log").read_text(errors="replace")
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{text[-4000:]}"
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    return {name: [seen[name] for seen in per_rank] for name in SCENARIOS}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Callable[[str, str], list[dict]]:
    """``scenario(name, device)``: what each rank saw in scenario ``name`` on ``device``."""
    runs: dict[str, dict[str, list[dict]]] = {}

    def seen(name: str, device: str = "cpu") -> list[dict]:
        if device not in runs:
            runs[device] = _run_all(tmp_path_factory.mktemp(f"ddp_{device}"), device)
        results = runs[device][name]
        for rank, result in enumerate(results):
            if "error" in result:
                pytest.fail(f"rank {rank} failed in scenario {name}:\n{result['error']}")
        return results

    return seen


def _assert_same(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if value is None:
            assert actual[key] is None, key
        else:
            torch.testing.assert_close(actual[key], value, atol=atol, rtol=0, msg=key)


# -- distributed behaviour -----------------------------------------------------------------------
def test_sync_params_gives_every_rank_the_source_weights_and_buffers(scenario):
    ranks = scenario("sync_params")
    assert not torch.equal(ranks[0]["before"]["0.weight"], ranks[1]["before"]["0.weight"])
    assert ranks[1]["before"]["1.num_batches_tracked"] == 2
    for seen in ranks:
        _assert_same(seen["from_0"], ranks[0]["before"])
        _assert_same(seen["from_1"], ranks[1]["shifted"])


@pytest.mark.parametrize("device", DEVICES)
def test_all_reduce_gradients_is_the_full_batch_gradient(scenario, device):
    ranks = scenario("all_reduce", device)
    x, y = _data(8)
    reference = _reference_grads(_linear(), x, y)
    for seen in ranks:
        _assert_same(seen["synced"], reference, atol=1e-6)
        mean = {k: (ranks[0]["local"][k] + ranks[1]["local"][k]) / 2 for k in reference}
        _assert_same(seen["synced"], mean, atol=1e-6)


def test_missing_gradients_count_as_zero_and_unused_parameters_stay_none(scenario):
    ranks = scenario("missing_grads")
    local0, local1 = ranks[0]["local"], ranks[1]["local"]
    assert local0["b.weight"] is None and local1["b.weight"] is not None
    for seen in ranks:
        synced = seen["synced"]
        torch.testing.assert_close(
            synced["a.weight"], (local0["a.weight"] + local1["a.weight"]) / 2
        )
        torch.testing.assert_close(synced["b.weight"], local1["b.weight"] / 2)
        assert synced["unused.weight"] is None and synced["frozen.weight"] is None


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_all_reduce_matches_the_gradient_over_all_batches(scenario, device):
    ranks = scenario("weighted", device)
    x, y = _data(16)
    batch_grads = [
        _reference_grads(_linear(), x[4 * b : 4 * b + 4], y[4 * b : 4 * b + 4]) for b in range(4)
    ]
    mean_of_batches = {k: sum(g[k] for g in batch_grads) / 4 for k in batch_grads[0]}
    full = _reference_grads(_linear(), x, y)  # equal batch sizes: the same thing
    for seen in ranks:
        _assert_same(seen["synced"], mean_of_batches, atol=1e-6)
        _assert_same(seen["synced"], full, atol=1e-6)


def test_a_rank_with_count_zero_contributes_nothing(scenario):
    ranks = scenario("weighted_zero")
    x, y = _data(8)
    reference = _reference_grads(_linear(), x, y)  # rank 1's two batches, averaged
    for seen in ranks:
        _assert_same(seen["synced"], reference, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_sync_buffers_averages_batchnorm_stats_and_takes_rank0_counters(scenario, device):
    ranks = scenario("sync_buffers", device)
    b0, b1 = ranks[0]["before"], ranks[1]["before"]
    assert not torch.allclose(b0["running_var"], b1["running_var"])
    for seen in ranks:
        after = seen["after"]
        for key in ("running_mean", "running_var"):
            torch.testing.assert_close(after[key], (b0[key] + b1[key]) / 2, atol=1e-6, rtol=0)
        assert after["num_batches_tracked"].dtype == torch.int64
        assert int(after["num_batches_tracked"]) == int(b0["num_batches_tracked"]) == 1


def test_average_params_equal_and_weighted(scenario):
    ranks = scenario("average_params")
    b0, b1 = ranks[0]["before"], ranks[1]["before"]
    s0, s1 = ranks[0]["shifted"], ranks[1]["shifted"]
    for rank, seen in enumerate(ranks):
        _assert_same(seen["equal"], {k: (b0[k] + b1[k]) / 2 for k in b0}, atol=1e-6)
        _assert_same(seen["weighted"], {k: 0.75 * s0[k] + 0.25 * s1[k] for k in s0}, atol=1e-6)
        mine, avg = seen["before"], seen["equal"]
        flat = torch.cat([mine[k].reshape(-1) for k in mine])
        flat_avg = torch.cat([avg[k].reshape(-1) for k in avg])
        expected = float((flat - flat_avg).norm() / flat_avg.norm())
        assert seen["divergence"] == pytest.approx(expected, rel=1e-5), rank
        assert seen["divergence"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_keeps_replicas_equal_to_single_process_training(scenario, device):
    ranks = scenario("training", device)  # rank 0 serves the store (RANK0_HOSTS)
    _assert_same(ranks[1]["final"], ranks[0]["final"])
    model = _mlp(seed=0)  # rank 0's init, which sync_params handed to rank 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x, y = _data(8, seed=step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    _assert_same(ranks[0]["final"], _state(model), atol=1e-5)
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0]


def test_wrap_reuses_an_existing_group_and_leaves_it_up(scenario):
    for seen in scenario("reuse_group"):
        assert "process group already initialised" in seen["wrong_rank"]
        assert seen["still_up"]
        assert float(seen["probe"]) == WORLD


def test_mismatched_models_fail_on_every_rank_and_release_the_group(scenario):
    for seen in scenario("mismatched_models"):
        assert "every rank must wrap the same architecture" in seen["message"]
        assert not seen["group_left"]


# -- bad input, in this process ------------------------------------------------------------------
def _rdv(world: int = 1, **kw: Any) -> Rendezvous:
    return Rendezvous.tcp(HOST, _free_port(), world, is_host=True, timeout_s=10.0, **kw)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"host": ""}, "host=''"),
        ({"port": 0}, "port=0"),
        ({"port": 70000}, "port=70000"),
        ({"world_size": 0}, "world_size=0"),
        ({"timeout_s": 0.0}, "timeout_s=0.0"),
    ],
)
def test_rendezvous_rejects_bad_values(kwargs, needle):
    args = {"host": HOST, "port": 29500, "world_size": 2, "is_host": True, **kwargs}
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        Rendezvous.tcp(**args)


def test_rendezvous_from_env_reads_torchrun_variables():
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "0"}
    rdv = Rendezvous.from_env({**env, "LOCAL_RANK": "0"})
    assert (rdv.host, rdv.port, rdv.world_size, rdv.rank, rdv.local_rank) == (
        "10.0.0.5",
        29500,
        4,
        0,
        0,
    )
    assert rdv.is_host
    assert not Rendezvous.from_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}).is_host
    assert not Rendezvous.from_env({**env, "RANK": "2"}).is_host
    with pytest.raises(RuntimeError, match="MASTER_PORT is not set"):
        Rendezvous.from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(RuntimeError, match="WORLD_SIZE='four'"):
        Rendezvous.from_env({**env, "WORLD_SIZE": "four"})
    with pytest.raises(ValueError, match=r"rank=4: must be an integer in \[0, 4\)"):
        Rendezvous.from_env({**env, "RANK": "4"})


@pytest.mark.parametrize(
    ("rank", "kwargs", "needle"),
    [
        (2, {}, r"rank=2: must be an integer in \[0, 2\)"),
        (-1, {}, r"rank=-1: must be an integer in \[0, 2\)"),
        (None, {}, "rank=None: pass this process's rank"),
        (0, {"backend": "nccl"}, "backend='nccl' with device=cpu"),
        (0, {"backend": "mpi"}, "backend='mpi'"),
    ],
)
def test_wrap_rejects_bad_input_before_joining(rank, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Ddp.wrap(_linear(), "cpu", rank, _rdv(world=2), **kwargs)
    assert not dist.is_initialized()


def test_wrap_rejects_a_rank_the_environment_contradicts_and_misplaced_models():
    env = {"MASTER_ADDR": HOST, "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}
    with pytest.raises(ValueError, match="rank=0: the environment says RANK=1"):
        Ddp.wrap(_linear(), "cpu", 0, Rendezvous.from_env(env))
    with pytest.raises(ValueError, match="move the model first"):
        Ddp.wrap(nn.Linear(2, 2, device="meta"), "cpu", 0, _rdv())
    assert not dist.is_initialized()


def test_an_unreachable_or_incomplete_rendezvous_fails_with_advice():
    lonely = Rendezvous.tcp(HOST, _free_port(), 2, is_host=False, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="could not reach the rendezvous store"):
        Ddp.wrap(_linear(), "cpu", 1, lonely)
    alone = Rendezvous.tcp(HOST, _free_port(), 2, is_host=True, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="not all 2 ranks joined the rendezvous"):
        Ddp.wrap(_linear(), "cpu", 0, alone)
    assert not dist.is_initialized()


def test_collectives_reject_bad_arguments_on_a_single_rank_group():
    model = _linear()
    with Ddp.wrap(model, "cpu", 0, _rdv()) as ddp:
        assert (ddp.rank, ddp.world_size, ddp.device) == (0, 1, torch.device("cpu"))
        for counts, needle in [
            ([3, 1], r"needs one entry per rank \(world_size=1\), got 2"),
            ([-1], "every entry must be an integer >= 0"),
            ([True], "every entry must be an integer >= 0"),
            ([0], "no rank accumulated a batch"),
        ]:
            with pytest.raises(ValueError, match=needle):
                ddp.weighted_all_reduce_gradients(counts)
        with pytest.raises(ValueError, match=r"src=1: must be an integer in \[0, 1\)"):
            ddp.sync_params(src=1)
        with pytest.raises(ValueError, match=r"weight=1.5: must be in \[0, 1\]"):
            ddp.average_params(weight=1.5)
        x, y = _data(12)
        for part in range(3):  # the contract: three plain backward passes, not divided
            F.mse_loss(model(x[4 * part : 4 * part + 4]), y[4 * part : 4 * part + 4]).backward()
        ddp.weighted_all_reduce_gradients([3])
        _assert_same(_grads(model), _reference_grads(_linear(), x, y), atol=1e-6)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="Ddp is closed"):
        ddp.all_reduce_gradients()
