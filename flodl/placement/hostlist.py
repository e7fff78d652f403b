"""SLURM's compressed node lists (``node[001-004,7],gpu-a``): the first host is rank 0's.

``scontrol show hostnames`` is SLURM's own expansion and is used when it is on PATH; otherwise
the compressed form is parsed here (the grammar Lightning's ``SLURMEnvironment`` also handles:
comma-separated names, each with optional bracketed ranges that keep zero padding).
"""

from __future__ import annotations

import re
import shutil
import subprocess

_TOKEN = re.compile(r"([^,\[]+)(\[[^\]]*\])?([^,\[]*)")


def expand(nodelist: str) -> list[str]:
    """Every host of a compressed SLURM node list, in order."""
    hosts: list[str] = []
    pos, text = 0, nodelist.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"cannot parse SLURM node list {nodelist!r} at {text[pos:]!r}")
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
        else:
            hosts.extend(f"{prefix}{n}{suffix}" for n in _ranges(ranges[1:-1], nodelist))
        pos = match.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError(f"cannot parse SLURM node list {nodelist!r} at {text[pos:]!r}")
            pos += 1
    return hosts


def _ranges(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in SLURM node list {nodelist!r}")
        width = len(lo)
        end = int(hi) if sep else int(lo)
        if end < int(lo):
            raise ValueError(f"descending range {part!r} in SLURM node list {nodelist!r}")
        out.extend(str(n).zfill(width) for n in range(int(lo), end + 1))
    return out


def root_node(nodelist: str) -> str:
    """The first host of the node list (where SLURM's task 0 runs with the default layout)."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            shown = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.split()
            if shown:
                return shown[0]
        except (OSError, subprocess.SubprocessError):
            pass  # fall back to parsing
    hosts = expand(nodelist)
    if not hosts:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return hosts[0]
