"""The one rule every entry applies to a key (an HTTP header's, a function's, an MCP call's)."""

from __future__ import annotations

from typing import TypeGuard

MAX_KEY_LENGTH = 255


def is_valid_key(key: object) -> TypeGuard[str]:
    """Whether ``key`` is a key: a string of 1-255 visible ASCII characters ("!" to "~"),
    which every store keeps as it is and a header can carry bare."""
    return (
        isinstance(key, str)
        and 1 <= len(key) <= MAX_KEY_LENGTH
        and key.isascii()
        and key.isprintable()
        and " " not in key
    )


def key_rule(name: str) -> str:
    """What a key named ``name`` must be, for an error that refuses one."""
    return f"{name} must be 1-{MAX_KEY_LENGTH} visible ASCII characters"
