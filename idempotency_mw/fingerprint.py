"""The request fingerprint: what must match for a repeated key to be the same request."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def request_fingerprint(
    method: str,
    route: str,
    path: str,
    query: bytes,
    headers: Sequence[tuple[str, str]],
    body: bytes,
) -> str:
    """Hex SHA-256 over length-prefixed fields, so no two field splits share a hash."""
    fields = [method.encode(), route.encode(), path.encode(), query]
    head = [_framed(value) for value in fields]
    head.append(len(headers).to_bytes(8, "big"))
    for name, value in headers:
        head += (_framed(name.encode("latin-1")), _framed(value.encode("latin-1")))
    head.append(len(body).to_bytes(8, "big"))
    digest = hashlib.sha256(b"".join(head))
    digest.update(body)
    return digest.hexdigest()


def _framed(value: bytes) -> bytes:
    return len(value).to_bytes(8, "big") + value


def credential_digest(values: Sequence[tuple[str, str]]) -> str:
    """Hex SHA-256 over length-prefixed credential names and values (never stored in clear)."""
    digest = hashlib.sha256()
    for name, value in values:
        for field in (name, value):
            encoded = field.encode("utf-8", "surrogateescape")
            digest.update(len(encoded).to_bytes(8, "big"))
            digest.update(encoded)
    return digest.hexdigest()


def canonical_json(body: bytes) -> bytes | None:
    """A JSON body in canonical form (sorted keys, no insignificant whitespace, numbers as
    parsed), or ``None`` when the body is not JSON (it is then fingerprinted as bytes)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )
