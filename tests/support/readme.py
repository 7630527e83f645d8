"""The fenced code blocks of the README and the docs pages, with the marker that may precede each.

A marker is a line ``<!-- docs: WHAT -->`` right before a block: it names a block that a test
takes from a page (a file, settings, commands) or says why a block does not run as written.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_MARKER = re.compile(r"^\s*<!-- docs: (?P<what>.+?) -->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, first line number and marker (if any)."""

    language: str
    text: str
    line: int
    marker: str | None


def pages() -> list[Path]:
    """The README and every page of the docs, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of a page, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    marker: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        if matched := _MARKER.match(line):
            marker = matched["what"]
        elif fence := _FENCE.match(line):
            end = index + 1
            while lines[end].strip() != "```":
                end += 1
            text = textwrap.dedent("\n".join(lines[index + 1 : end])) + "\n"
            found.append(Block(fence["language"], text, index + 2, marker))
            marker = None
            index = end
        elif line.strip():
            marker = None  # a marker applies to the block right after it only
        index += 1
    return found


def marked(what: str) -> Block:
    """The one block of the README or the docs whose marker is ``what``."""
    matching = [block for page in pages() for block in blocks(page) if block.marker == what]
    assert len(matching) == 1, f"expected one block marked {what!r}, found {len(matching)}"
    return matching[0]


def commands(block: Block) -> list[str]:
    """The command lines of a shell block (comments and blank lines left out)."""
    return [
        line.strip()
        for line in block.text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def settings(block: Block) -> dict[str, str]:
    """The ``name = value`` lines of an ini block."""
    pairs = (line.split("=", 1) for line in block.text.splitlines() if "=" in line)
    return {name.strip(): value.strip() for name, value in pairs}
