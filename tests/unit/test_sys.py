"""GPU detection against a fake nvidia-smi and a fake KFD topology; no GPU or driver needed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import flodl.placement.gpus as fsys
from flodl.placement.gpus import GpuInfo, apply_visibility, detect_gpus

UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-5555-6666-7777-888888888888"
MIG_B = "MIG-cccccccc-9999-0000-1111-222222222222"
FULL_OUT = (
    f"0, NVIDIA H100 80GB HBM3, {UUID_A}, 81559, 9.0\n"
    f"1, NVIDIA GeForce RTX 3090, {UUID_B}, 24576, 8.6\n"
)
LIST_OUT = (
    f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {UUID_A})\n"
    f"GPU 1: NVIDIA GeForce RTX 3090 (UUID: {UUID_B})\n"
    f"  MIG 1g.5gb      Device  0: (UUID: {MIG_B})\n"
)

Responder = Callable[[list[str]], subprocess.CompletedProcess[str]]


def _answer(stdout: str, rc: int = 0, stderr: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["nvidia-smi"], rc, stdout, stderr)


def _default_responder(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    if cmd[1:] == ["-L"]:
        return _answer(LIST_OUT)
    return _answer(FULL_OUT)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    # Never read the real sysfs: these tests must mean the same on an AMD box.
    monkeypatch.setattr(fsys, "_KFD_NODES", tmp_path / "no-kfd")


class FakeSmi:
    """Stands in for ``subprocess.run`` of nvidia-smi; records every command it answers."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.respond: Responder = _default_responder

    def run(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert kwargs.get("timeout") == 10.0, "nvidia-smi must always run with a timeout"
        self.calls.append(list(cmd))
        return self.respond(cmd)


@pytest.fixture
def smi(monkeypatch: pytest.MonkeyPatch) -> FakeSmi:
    fake = FakeSmi()
    monkeypatch.setattr(fsys.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(fsys.subprocess, "run", fake.run)
    return fake


def test_two_gpus_of_different_models(smi: FakeSmi) -> None:
    gpus = detect_gpus()
    assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 3090"]
    assert [(g.index, g.physical_index) for g in gpus] == [(0, 0), (1, 1)]
    assert [g.uuid for g in gpus] == [UUID_A, UUID_B]
    assert [g.total_memory_mb for g in gpus] == [81559, 24576]
    assert [g.arch_label() for g in gpus] == ["sm_90", "sm_86"]
    assert smi.calls[0][1:] == [
        "--query-gpu=index,name,uuid,memory.total,compute_cap",
        "--format=csv,noheader,nounits",
    ]


@pytest.mark.parametrize(
    ("mask", "physical"),
    [
        ("1", [1]),
        ("1,0", [1, 0]),
        (UUID_B, [1]),
        (UUID_B[:12], [1]),  # a unique UUID prefix is enough, as with CUDA
        (f"{UUID_A},1", [0, 1]),
        ("0,7,1", [0]),  # an unknown index ends the list
        ("0,0", [0]),  # so does a repeated one
        ("GPU-", []),  # an ambiguous prefix is unknown
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
    ],
)
def test_cuda_visible_devices(
    smi: FakeSmi, monkeypatch: pytest.MonkeyPatch, mask: str, physical: list[int]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    gpus = detect_gpus()
    assert [g.physical_index for g in gpus] == physical
    assert [g.index for g in gpus] == list(range(len(physical)))


def test_visible_index_is_renumbered(smi: FakeSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    (gpu,) = detect_gpus()
    assert (gpu.index, gpu.physical_index, gpu.name) == (0, 1, "NVIDIA GeForce RTX 3090")


def test_mig_entries_resolve_to_their_parent(smi: FakeSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_B)
    (gpu,) = detect_gpus()
    assert (gpu.index, gpu.physical_index, gpu.uuid) == (0, 1, MIG_B)
    assert gpu.arch_label() == "sm_86"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{UUID_A}/1/0")
    assert [g.physical_index for g in detect_gpus()] == [0]


def test_missing_binary_gives_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("subprocess.run called without an nvidia-smi binary")

    monkeypatch.setattr(fsys.shutil, "which", lambda name: None)
    monkeypatch.setattr(fsys.subprocess, "run", must_not_run)
    assert detect_gpus() == []


def test_timeout_gives_no_gpus_and_no_retry(smi: FakeSmi) -> None:
    def hang(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(cmd, 10.0)

    smi.respond = hang
    assert detect_gpus() == []
    assert len(smi.calls) == 1, "a hung nvidia-smi must not be asked twice"


@pytest.mark.parametrize(
    "answer",
    [
        _answer("", rc=9, stderr="NVIDIA-SMI has failed: couldn't communicate with the driver"),
        _answer("this is not csv\n"),
        _answer("zero, H100, GPU-x, 1, 9.0\n"),
        _answer("0, H100, GPU-x\n"),
        _answer("0, H100, GPU-x, lots, 9.0\n"),
    ],
    ids=["driver-error", "garbage", "bad-index", "too-few-columns", "bad-memory"],
)
def test_failures_give_no_gpus(smi: FakeSmi, answer: subprocess.CompletedProcess[str]) -> None:
    smi.respond = lambda cmd: answer
    assert detect_gpus() == []


def test_old_driver_without_compute_cap_falls_back(smi: FakeSmi) -> None:
    def old_driver(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        if "compute_cap" in cmd[1]:
            return _answer('Field "compute_cap" is not a valid field to query.\n', rc=2)
        return _answer(f"0, Tesla V100-SXM2-16GB, {UUID_A}, 16160\n")

    smi.respond = old_driver
    (gpu,) = detect_gpus()
    assert (gpu.name, gpu.total_memory_mb, gpu.compute_capability) == (
        "Tesla V100-SXM2-16GB",
        16160,
        None,
    )
    assert gpu.arch_label() is None
    assert len(smi.calls) == 2


def test_warning_lines_are_skipped(smi: FakeSmi) -> None:
    smi.respond = lambda cmd: _answer(
        "WARNING: infoROM is corrupted at gpu 0000:01:00.0\n" + FULL_OUT
    )
    assert [g.physical_index for g in detect_gpus()] == [0, 1]


def test_commas_in_names_and_missing_fields(smi: FakeSmi) -> None:
    smi.respond = lambda cmd: _answer("0, Odd, Name GPU, [N/A], [N/A], 7.5\n")
    (gpu,) = detect_gpus()
    assert (gpu.name, gpu.uuid, gpu.total_memory_mb, gpu.arch_label()) == (
        "Odd, Name GPU",
        None,
        0,
        "sm_75",
    )


def test_apply_visibility_keeps_everything_when_unset() -> None:
    gpus = [GpuInfo(i, f"g{i}", None, 1, "9.0") for i in range(3)]
    assert apply_visibility(gpus, None) == gpus
    assert gpus[2].physical_index == 2


def _kfd_node(root: Path, n: int, simd: int, name: str = "", gfx: int = 0, mem: int = 0) -> None:
    node = root / str(n)
    node.mkdir(parents=True)
    props = f"cpu_cores_count 0\nsimd_count {simd}\ngfx_target_version {gfx}\nunique_id {n}\n"
    (node / "properties").write_text(props)
    if name:
        (node / "name").write_text(name + "\n")
    if mem:
        (node / "mem_banks" / "0").mkdir(parents=True)
        (node / "mem_banks" / "0" / "properties").write_text(f"size_in_bytes {mem}\n")


@pytest.fixture
def kfd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    root = tmp_path / "nodes"
    _kfd_node(root, 0, 0, "")  # the CPU node: no SIMD units
    _kfd_node(root, 1, 440, "gfx90a", gfx=90010, mem=64 * 1024**3)
    _kfd_node(root, 2, 304, "gfx942", gfx=90402)
    monkeypatch.setattr(fsys, "_KFD_NODES", root)
    monkeypatch.setattr(fsys.shutil, "which", lambda name: None)
    return root


def test_amd_gpus_from_kfd_topology(kfd: Path) -> None:
    gpus = detect_gpus()
    assert [(g.index, g.name, g.vendor) for g in gpus] == [
        (0, "gfx90a", "amd"),
        (1, "gfx942", "amd"),
    ]
    assert [g.arch_label() for g in gpus] == ["gfx90a", "gfx942"]
    assert gpus[0].total_memory_mb == 64 * 1024


def test_amd_visibility_masks(kfd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert [(g.index, g.physical_index) for g in detect_gpus()] == [(0, 1)]
    # ROCr renumbers first; HIP's indices then refer to what ROCr left visible.
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "1,0")
    assert [(g.index, g.physical_index) for g in detect_gpus()] == [(0, 0)]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "-1")
    assert detect_gpus() == []


def test_importing_flodl_sys_does_not_import_torch() -> None:
    code = (
        "import sys, flodl.placement.gpus, flodl.monitor; flodl.placement.gpus.detect_gpus(); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
