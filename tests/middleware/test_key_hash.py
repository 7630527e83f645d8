"""``key_hash``: one hash per scope and key pair, whatever characters either holds."""

from __future__ import annotations

import pytest

from idempotency_mw.values.metrics import key_hash


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("tenant\0a", "key"), ("tenant", "a\0key")),  # the old separator inside a name
        (("ab", "c"), ("a", "bc")),
        (("", "1:x"), ("1:x", "")),
        (("é", "x"), ("e", "\u0301x")),
    ],
)
def test_two_pairs_never_share_a_hash(first: tuple[str, str], second: tuple[str, str]) -> None:
    assert key_hash(*first) != key_hash(*second)


def test_the_hash_is_twelve_hex_characters() -> None:
    digest = key_hash("alice", "order-1")
    assert len(digest) == 12
    assert set(digest) <= set("0123456789abcdef")
