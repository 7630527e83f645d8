"""An MkDocs hook: the docstrings' Sphinx roles (``:class:`~a.B```) shown as plain code (``B``).

The docstrings are written for Sphinx-style readers; mkdocstrings renders them as Markdown, where
a role would show as ``:class:`` before its code span.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(
    r":(?:class|func|meth|attr|exc|data|mod|obj):<code>(?P<tilde>~?)(?P<name>[^<]+)</code>"
)


def _shown(match: re.Match[str]) -> str:
    name = match["name"]
    return f"<code>{name.rsplit('.', 1)[-1] if match['tilde'] else name}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """Drop the role, and with ``~`` keep the name's last part only, as Sphinx does."""
    return _ROLE.sub(_shown, html)
