"""Find the code blocks of README.md, bench/README.md and docs/ and say how each is checked.

The convention (docs/contributing.md): a fenced block's language says what it is, and an
optional HTML comment on the line right before its opening fence says how it is checked::

    <!-- snippet: skip reason=GPU -->
    <!-- snippet: slow -->
    <!-- snippet: session=demo file=conf/config.yaml -->
    <!-- snippet: group=elche -->
    <!-- snippet: rc=2 -->

``python`` blocks are compiled and run, ``bash`` blocks checked with ``bash -n`` and run,
``console`` blocks (``$ command`` lines, each followed by its expected output) run and compared,
``yaml`` blocks loaded with ``yaml.safe_load`` and, with ``group=NAME``, validated against that
config group's pydantic model. ``skip`` keeps only the parse/validation (the reason says why the
block cannot run here). ``text`` blocks are output listings and diagrams, not code.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANGS = {"python", "bash", "console", "yaml", "text"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<lang>[\w-]*)[^\n]*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:(?P<body>.*?)-->\s*$")


@dataclass
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    opts: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skip(self) -> str | None:
        """Why the block is not run here (None: it runs)."""
        if "skip" in self.opts:
            return self.opts.get("reason") or "marked skip"
        return None


def parse_opts(body: str) -> dict[str, str]:
    """``skip reason="needs two GPUs" group=elche`` -> {"skip": "", "reason": ..., ...}."""
    opts: dict[str, str] = {}
    for word in shlex.split(body):
        key, _, value = word.partition("=")
        opts[key] = value
    return opts


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *docs]


def snippets(path: Path) -> list[Snippet]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group("indent"), m.group("ticks"), m.group("lang")
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1  # the closing fence
        prev = lines[start - 1] if start > 0 else ""
        marker = MARKER.match(prev)
        opts = parse_opts(marker.group("body")) if marker else {}
        found.append(Snippet(path, start + 1, lang, "\n".join(body) + "\n", opts))
    return found


def all_snippets() -> list[Snippet]:
    return [s for page in pages() for s in snippets(page)]
