"""MkDocs hook: render the config reference from the pydantic schema at build time.

A page writes ``<!-- schema: ClassName prefix -->`` (a class importable from ``flodl.config``
and the dotted key its fields live under, ``-`` for the top level); the hook replaces the
marker with a table of that model's fields: key, type, default and the field's own
``description``. Nested models get a table of their own, after the parent's, unless the marker
ends in ``flat``. The tables are
generated from the code on every build, so the reference cannot drift from the schema.
"""

from __future__ import annotations

import enum
import importlib
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = re.compile(r"^<!-- schema: (\w+) (\S+)( flat)? -->$", re.MULTILINE)  # a line of its own


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(its own table)"
        return f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "**required**"
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`"


def _nested(tp: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's type refers to (``X``, ``X | None``, ``list[X]``)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(tp):
        found.extend(_nested(arg))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def model_tables(
    model: type[BaseModel], prefix: str, seen: set[str] | None = None, flat: bool = False
) -> str:
    """Markdown tables for ``model``'s fields under the dotted ``prefix`` (``-``: top level)."""
    seen = set() if seen is None else seen
    lead = "" if prefix == "-" else prefix + "."
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    later: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        rows.append(
            f"| `{lead}{key}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))}"
            f" | {_cell(field.description or '')} |"
        )
        for sub in [] if flat else _nested(field.annotation):
            later.append((sub, f"{lead}{key}" + ("[]" if "list" in str(field.annotation) else "")))
    doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "`")
    out = [f"`{model.__name__}`: {doc}" if doc else f"`{model.__name__}`", "", *rows]
    for sub, where in later:
        if where in seen:
            continue
        seen.add(where)
        out += ["", f"#### `{where}`", "", model_tables(sub, where, seen)]
    return "\n".join(out)


def render(markdown: str) -> str:
    config = importlib.import_module("flodl.config")

    def table(match: re.Match[str]) -> str:
        model = getattr(config, match.group(1))
        return model_tables(model, match.group(2), flat=bool(match.group(3)))

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown) if "<!-- schema:" in markdown else markdown
