"""Values that travel between the middleware and a store."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass


class RecordStatus(enum.StrEnum):
    """Lifecycle of one key's record, as stored."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    #: The handler ran but its response exceeded the size limit, so it cannot be replayed.
    UNREPLAYABLE = "unreplayable"
    #: The handler's effect was committed (``fence``), but it gave no response worth recording.
    COMMITTED = "committed"


class ClaimOutcome(enum.Enum):
    """What a claim found; exactly one concurrent claim of a key gets ``ACQUIRED``."""

    ACQUIRED = "acquired"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"
    UNREPLAYABLE = "unreplayable"
    #: The record is bound to other credentials: never replayed to this caller, never re-run.
    CREDENTIAL_MISMATCH = "credential_mismatch"
    #: The effect was committed (``fence``) but no response is available.
    COMMITTED_WITHOUT_RESPONSE = "committed_without_response"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as recorded: replayed byte for byte."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to :meth:`Store.claim`.

    ``token`` is set only for ``ACQUIRED`` and must be presented to complete, renew or release the
    claim; ``response`` is set only for ``REPLAY``.
    """

    outcome: ClaimOutcome
    token: str | None = None
    response: StoredResponse | None = None


def new_token() -> str:
    """A fresh claim token: 32 hex digits, unguessable."""
    return secrets.token_hex(16)


def pack_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """Headers as bytes: a length-prefixed name and value per header (no pickle, no JSON)."""
    parts: list[bytes] = []
    for name, value in headers:
        parts += [len(name).to_bytes(4, "big"), name, len(value).to_bytes(4, "big"), value]
    return b"".join(parts)


def unpack_headers(packed: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """The inverse of :func:`pack_headers`."""
    fields: list[bytes] = []
    offset = 0
    while offset < len(packed):
        length = int.from_bytes(packed[offset : offset + 4], "big")
        fields.append(packed[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return tuple(zip(fields[::2], fields[1::2], strict=True))
