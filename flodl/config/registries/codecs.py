"""The compression codecs of ``elche.compress``, each declared once: how an average's change
travels.

A codec is a :class:`CodecSpec` here (what the schema, the validator, the collectives, the
controller's streaming sum and the docs read) and, on the torch side, the :class:`WireCodec`
its ``impl`` names (flodl/runtime/sync/compress.py: ``encode``/``decode`` a change, and
``decode_piece`` for the controller's sum as pieces stream in). The registry :data:`CODECS` is
read by ``elche.compress`` (the names it accepts), :class:`Compressor` (the collective modes:
an all-reduce of a narrower dtype, or an all-gather of encoded payloads, with error feedback
where the codec keeps it), the controller modes' codec (flodl/runtime/sync/codec.py) and the
docs' table (docs/guides/cpu-rig.md). Adding one: docs/design/registries.md. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

#: ``elche.compress=none``: averages travel whole, in fp32.
NO_CODEC = "none"


@dataclass(frozen=True)
class CodecSpec:
    """One codec: its wire form and how a collective carries it."""

    name: str
    summary: str  # the docs' table
    impl: str  # dotted path of its WireCodec class (flodl/runtime/sync/compress.py)
    wire_dtype: str  # torch dtype name of the values on the wire ("bfloat16", "int8", ...)
    value_bytes: float  # bytes per value on the wire, scales included (the docs' table)
    collective: Literal["all_reduce", "all_gather"]  # how the collective modes carry it
    error_feedback: bool = False  # what an encoding lost is added to the next change
    scaled: bool = False  # one fp32 scale per block travels before the values
    streams: bool = True  # its values map to positions piece by piece (the controller sums
    # them as they stream in); a codec whose payload does not (sparse indices) is refused in
    # the controller's modes


def _codecs(*specs: CodecSpec) -> Mapping[str, CodecSpec]:
    return MappingProxyType({s.name: s for s in specs})


_IMPL = "flodl.runtime.sync.compress."

#: The registry: every codec ``elche.compress`` names.
CODECS: Mapping[str, CodecSpec] = _codecs(
    CodecSpec(
        "bf16",
        "the change in bfloat16: half the bytes, an all-reduce of bf16",
        _IMPL + "CastCodec",
        "bfloat16",
        2.0,
        "all_reduce",
    ),
    CodecSpec(
        "fp16",
        "the change in float16: half the bytes, an all-reduce of fp16",
        _IMPL + "CastCodec",
        "float16",
        2.0,
        "all_reduce",
    ),
    CodecSpec(
        "int8",
        "the change in int8 with one fp32 scale per block of 4096 values, error feedback: a "
        "quarter of the bytes, an all-gather of the encoded changes",
        _IMPL + "Int8Codec",
        "int8",
        1.0 + 4.0 / 4096,
        "all_gather",
        error_feedback=True,
        scaled=True,
    ),
)

#: Every value ``elche.compress`` accepts, ``none`` first.
COMPRESS_NAMES: tuple[str, ...] = (NO_CODEC, *CODECS)


def known_codec(name: str) -> str:
    """``name`` if it names a codec (or ``none``); else a ``ValueError`` naming them all."""
    if name not in COMPRESS_NAMES:
        quoted = [f"'{n}'" for n in COMPRESS_NAMES]
        raise ValueError(f"Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")
    return name
