"""The rig's link profiles, each declared once: the figures of a named wire.

The registry :data:`LINK_PROFILES` is read by the schema (``cluster.link.profile``,
``between_hosts``, a host's ``link``: the names it accepts), the rig's link model
(:mod:`flodl.rig.links`: the figures it charges) and the docs' table (docs/guides/cpu-rig.md).
Adding a profile is one entry here, its test and nothing else (docs/design/registries.md).
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class LinkProfile:
    """A named wire: bandwidth (Gbit/s per direction), latency per message or ring hop (ms),
    and whether each hop is staged through host memory (every byte copied twice)."""

    name: str
    bandwidth_gbps: float
    latency_ms: float
    staged: bool
    what: str  # the hardware it stands for (the docs' table)


#: ``none``: loopback, nothing charged (the rig without ``cluster.link``).
NO_LINK = "none"


def _profiles(*profiles: LinkProfile) -> Mapping[str, LinkProfile]:
    return MappingProxyType({p.name: p for p in profiles})


#: The registry: every named link profile.
LINK_PROFILES: Mapping[str, LinkProfile] = _profiles(
    LinkProfile("nvlink", 450.0, 0.005, False, "NVLink bridge of two consumer cards (56 GB/s)"),
    LinkProfile("pcie_no_p2p", 200.0, 0.02, True, "PCIe 4.0 x16 (~25 GB/s) without peer-to-peer"),
    LinkProfile("10gbe", 10.0, 0.05, False, "10 Gbit Ethernet between hosts"),
    LinkProfile("1gbe", 1.0, 0.1, False, "1 Gbit Ethernet between hosts"),
)

#: Every name ``cluster.link`` accepts, ``none`` first.
LINK_NAMES: tuple[str, ...] = (NO_LINK, *LINK_PROFILES)


def known_link(name: str) -> str:
    """``name`` if it names a profile (or ``none``); else a ``ValueError`` naming them all."""
    if name not in LINK_NAMES:
        quoted = [f"'{n}'" for n in LINK_NAMES]
        raise ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")
    return name
