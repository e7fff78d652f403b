"""Which GPUs this process may use, found without importing torch or touching CUDA.

The launcher must never create a CUDA context before ranks exist (docs/design/process-model.md): a
parent holding a
context breaks heterogeneous rigs and forked children. So detection asks the driver's tools
instead: ``nvidia-smi`` for NVIDIA, the KFD topology in sysfs for AMD. Both honour the
``*_VISIBLE_DEVICES`` masks the way the CUDA/ROCm runtimes do, so ``len(detect_gpus())`` is the
number of devices ``torch.cuda.device_count()`` would report in a child.

Detection is best effort: any failure (no driver, timeout, unexpected output) means "no GPUs"
plus a debug log line, never an exception, because CPU-only machines are a supported target.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

logger = logging.getLogger(__name__)

_SMI_TIMEOUT_S = 10.0
_FULL_QUERY = "index,name,uuid,memory.total,compute_cap"
# Drivers older than ~510 reject ``compute_cap``; without it we still know which GPUs exist.
_BASIC_QUERY = "index,name,uuid,memory.total"
_KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")


@dataclass(frozen=True)
class GpuInfo:
    """One GPU visible to this process.

    ``index`` is the visible (renumbered) index, the one ``cuda:N`` uses in a child;
    ``physical_index`` is the driver's index (what ``nvidia-smi`` shows).
    """

    index: int
    name: str
    uuid: str | None
    total_memory_mb: int
    compute_capability: str | None
    physical_index: int | None = None
    vendor: str = "nvidia"

    def __post_init__(self) -> None:
        # Without a mask both indices agree; filling it here keeps hand-made infos simple.
        if self.physical_index is None:
            object.__setattr__(self, "physical_index", self.index)

    def arch_label(self) -> str | None:
        """Architecture tag: ``"sm_90"`` for compute capability 9.0, ``"gfx90a"`` on AMD."""
        cc = self.compute_capability
        if not cc:
            return None
        if self.vendor != "nvidia":
            return cc
        return "sm_" + cc.replace(".", "")


def detect_gpus() -> list[GpuInfo]:
    """GPUs this process may use, in visible order; ``[]`` when there are none or on any error.

    Physical indices follow ``nvidia-smi`` (PCI bus order). CUDA numbers devices the same way
    only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; its default (fastest first) can differ on a
    mixed rig, so rank processes should be started with that variable set.
    """
    gpus = _nvidia_gpus()
    if gpus:
        return gpus
    return _amd_gpus()


# ---------------------------------------------------------------- visibility masks


def apply_visibility(gpus: Sequence[GpuInfo], mask: str | None) -> list[GpuInfo]:
    """Filter and renumber ``gpus`` by a ``CUDA_VISIBLE_DEVICES``-style mask.

    ``None`` (unset) keeps every GPU. Entries are indices (matched against ``GpuInfo.index``)
    or UUIDs (a unique prefix is enough, as with CUDA); like the CUDA runtime, the first unknown
    or repeated entry ends the list, so ``""``, ``"-1"`` and ``"NoDevFiles"`` hide every device.
    """
    if mask is None:
        return [_renumber(g, i) for i, g in enumerate(gpus)]
    chosen: list[GpuInfo] = []
    for entry in mask.split(","):
        gpu = _resolve_entry(gpus, entry.strip())
        if gpu is None or gpu in chosen:
            break
        chosen.append(gpu)
    return [_renumber(g, i) for i, g in enumerate(chosen)]


def _resolve_entry(gpus: Sequence[GpuInfo], entry: str) -> GpuInfo | None:
    if not entry:
        return None
    if entry.lstrip("+").isdigit():
        wanted = int(entry)
        return next((g for g in gpus if g.index == wanted), None)
    if entry.startswith("MIG-GPU-"):
        # Old MIG syntax ``MIG-GPU-<parent uuid>/<gi>/<ci>``: the parent GPU hosts the slice.
        entry = entry[len("MIG-") :].split("/", 1)[0]
    elif entry.startswith("MIG-"):
        return _resolve_mig(gpus, entry)
    matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
    return matches[0] if len(matches) == 1 else None


def _resolve_mig(gpus: Sequence[GpuInfo], entry: str) -> GpuInfo | None:
    """A ``MIG-<uuid>`` entry names a slice; ``nvidia-smi -L`` says which GPU carries it."""
    parent = _mig_parents().get(entry.lower())
    gpu = next((g for g in gpus if g.physical_index == parent), None)
    # The slice shares the parent's architecture; its memory is a fraction we cannot see here.
    return None if gpu is None else replace(gpu, name=f"{gpu.name} MIG", uuid=entry)


def _renumber(gpu: GpuInfo, visible: int) -> GpuInfo:
    return replace(gpu, index=visible)


# ---------------------------------------------------------------- NVIDIA


def _run_smi(args: list[str]) -> subprocess.CompletedProcess[str] | None:
    """The finished ``nvidia-smi args`` call, or None (logged at debug) when it could not run."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        logger.debug("nvidia-smi not found on PATH: assuming no NVIDIA GPUs")
        return None
    try:
        return subprocess.run(
            [binary, *args], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("nvidia-smi %s failed: %s", " ".join(args), exc)
        return None


def _smi_stdout(args: list[str]) -> str | None:
    proc = _run_smi(args)
    if proc is None or proc.returncode != 0:
        if proc is not None:
            logger.debug("nvidia-smi exited %d: %s", proc.returncode, _tail(proc))
        return None
    return proc.stdout


def _query_smi() -> tuple[str, int] | None:
    """Raw ``--query-gpu`` output and its column count (old drivers get the basic query)."""
    proc = _run_smi([f"--query-gpu={_FULL_QUERY}", "--format=csv,noheader,nounits"])
    if proc is not None and proc.returncode == 0:
        return proc.stdout, _FULL_QUERY.count(",") + 1
    # Retry only for the one failure a second query can fix; a hung or driverless nvidia-smi
    # would just cost another timeout.
    if proc is None or "compute_cap" not in _tail(proc):
        if proc is not None:
            logger.debug("nvidia-smi exited %d: %s", proc.returncode, _tail(proc))
        return None
    out = _smi_stdout([f"--query-gpu={_BASIC_QUERY}", "--format=csv,noheader,nounits"])
    return None if out is None else (out, _BASIC_QUERY.count(",") + 1)


def _tail(proc: subprocess.CompletedProcess[str]) -> str:
    # nvidia-smi prints some errors on stdout, so look at both streams.
    return f"{proc.stdout or ''} {proc.stderr or ''}".strip()[-500:]


def _nvidia_gpus() -> list[GpuInfo]:
    answer = _query_smi()
    if answer is None:
        return []
    out, ncols = answer
    try:
        parsed = [_parse_smi_line(line, ncols) for line in out.splitlines()]
    except (ValueError, IndexError) as exc:
        logger.debug("unexpected nvidia-smi output (%s): %r", exc, out[:200])
        return []
    gpus = [g for g in parsed if g is not None]
    return apply_visibility(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _parse_smi_line(line: str, ncols: int) -> GpuInfo | None:
    parts = [p.strip() for p in line.split(",")]
    if not parts[0].isdigit():
        # Not a GPU row (blank, or a driver warning such as a corrupt infoROM notice):
        # every row of the query starts with the GPU's index.
        if parts != [""]:
            logger.debug("skipping nvidia-smi line %r", line)
        return None
    if len(parts) < ncols:
        raise ValueError(f"{len(parts)} columns, expected {ncols}")
    # Only the name may contain commas; glue the surplus back into it.
    extra = len(parts) - ncols
    name = ", ".join(parts[1 : 2 + extra])
    rest = parts[2 + extra :]
    index = int(parts[0])
    memory = rest[1]
    return GpuInfo(
        index=index,
        name=name,
        uuid=_known(rest[0]),
        total_memory_mb=int(float(memory)) if _known(memory) else 0,
        compute_capability=_known(rest[2]) if len(rest) > 2 else None,
        physical_index=index,
    )


def _known(value: str) -> str | None:
    """nvidia-smi prints ``[N/A]`` or ``[Not Supported]`` for missing fields."""
    return None if not value or value.startswith("[") else value


def _mig_parents() -> dict[str, int]:
    """``{mig uuid (lower case): physical GPU index}`` from ``nvidia-smi -L``."""
    out = _smi_stdout(["-L"]) or ""
    parents: dict[str, int] = {}
    current: int | None = None
    for line in out.splitlines():
        text = line.strip()
        if text.startswith("GPU ") and ":" in text:
            head = text[4 : text.index(":")]
            current = int(head) if head.isdigit() else None
        elif text.startswith("MIG ") and "UUID: " in text and current is not None:
            uuid = text.split("UUID: ", 1)[1].rstrip(")").strip()
            parents[uuid.lower()] = current
    return parents


# ---------------------------------------------------------------- AMD


def _amd_gpus() -> list[GpuInfo]:
    """GPU nodes of the KFD topology: nodes with SIMD units (CPU nodes report 0)."""
    if not _KFD_NODES.is_dir():
        return []
    try:
        nodes = sorted(_KFD_NODES.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
        gpus = [g for g in (_amd_node(n) for n in nodes) if g is not None]
    except (OSError, ValueError) as exc:
        logger.debug("cannot read the KFD topology at %s: %s", _KFD_NODES, exc)
        return []
    gpus = [replace(g, index=i, physical_index=i) for i, g in enumerate(gpus)]
    # ROCr applies its mask first; HIP (which also reads CUDA_VISIBLE_DEVICES) then filters
    # what ROCr left, by the already renumbered indices.
    gpus = apply_visibility(gpus, os.environ.get("ROCR_VISIBLE_DEVICES"))
    hip_mask = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return apply_visibility(gpus, hip_mask)


def _amd_node(node: Path) -> GpuInfo | None:
    props = _read_properties(node / "properties")
    if props.get("simd_count", 0) <= 0:
        return None
    name_file = node / "name"
    name = name_file.read_text().strip() if name_file.is_file() else ""
    unique = props.get("unique_id", 0)
    return GpuInfo(
        index=0,
        name=name or "AMD GPU",
        uuid=f"GPU-{unique:016x}" if unique else None,
        total_memory_mb=_amd_memory_mb(node),
        compute_capability=_gfx_name(props.get("gfx_target_version", 0)),
        vendor="amd",
    )


def _read_properties(path: Path) -> dict[str, int]:
    props: dict[str, int] = {}
    if not path.is_file():
        return props
    for line in path.read_text().splitlines():
        key, _, value = line.strip().partition(" ")
        if value.strip().lstrip("-").isdigit():
            props[key] = int(value)
    return props


def _amd_memory_mb(node: Path) -> int:
    banks = node / "mem_banks"
    if not banks.is_dir():
        return 0
    total = sum(_read_properties(b / "properties").get("size_in_bytes", 0) for b in banks.iterdir())
    return total // (1024 * 1024)


def _gfx_name(version: int) -> str | None:
    """KFD encodes gfx90a as 90010 (major*10000 + minor*100 + stepping)."""
    if version <= 0:
        return None
    major, rest = divmod(version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


__all__ = ["GpuInfo", "apply_visibility", "detect_gpus"]
