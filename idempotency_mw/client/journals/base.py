"""The Journal protocol, and an entry's fields as every journal stores them."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from idempotency_mw.client.values import JournalEntry, OperationState
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.wire.credentials import is_credential


@runtime_checkable
class Journal(Protocol):
    """Durable operation records, keyed by Idempotency-Key. Methods may block: the async
    client calls them in a worker thread, so implementations must be thread-safe.

    A lease (:meth:`acquire`) marks the one caller that sends an operation: others wait for its
    outcome, or take over once the lease lapses (its holder died).
    """

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation; if one with the same name and (non-null) ref exists,
        return that one unchanged instead."""
        ...

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key`` (its lease is left as it is)."""
        ...

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        ...

    def unsettled(self) -> list[JournalEntry]:
        """Entries neither confirmed nor failed, oldest first."""
        ...

    def acquire(self, key: str, holder: str, seconds: float) -> bool:
        """Take or renew the lease on the entry ``key`` for ``seconds``; ``False`` when another
        holder's lease has not lapsed (or there is no such entry). Renewing twice is harmless."""
        ...

    def release(self, key: str, holder: str) -> None:
        """End ``holder``'s lease on ``key``, if it still holds it."""
        ...

    def close(self) -> None:
        """Release the journal's resources."""
        ...


def needing_attention(journal: Journal) -> list[JournalEntry]:
    """The journal's entries a person has to look at, oldest first."""
    return [entry for entry in journal.unsettled() if entry.state.needs_attention]


#: The response header under which :func:`resolve` journals a person's note.
NOTE_HEADER = "idempotency-mw-note"


def resolve(journal: Journal, key: str, state: OperationState, note: str) -> JournalEntry:
    """Settle the entry ``key`` by hand as ``confirmed`` or ``failed`` (a person looked), with
    ``note`` journaled beside its last answer (a response header :data:`NOTE_HEADER`, so every
    journal keeps it); the entry as saved.

    Under the operation's lease, so that a caller sending it at that moment is not overwritten;
    raises :class:`~idempotency_mw.values.exceptions.ConfigurationError` when ``state`` is not
    settled, the entry is missing, or another caller holds it.
    """
    if not state.settled:
        raise ConfigurationError(f"an operation is resolved as confirmed or failed, not {state}")
    holder = f"resolve-{secrets.token_hex(8)}"
    if not journal.acquire(key, holder, 30.0):
        raise ConfigurationError("no such operation, or another caller is sending it now")
    try:
        entry = journal.get(key)
        if entry is None:
            raise ConfigurationError("no such operation")
        noted = (*entry.response_headers, (NOTE_HEADER, " ".join(note.split())))
        resolved = replace(entry, state=state, response_headers=noted)
        journal.save(resolved)
    finally:
        journal.release(key, holder)
    return resolved


#: A journal entry's fields, in the order of :func:`to_row` and :func:`from_row`.
FIELDS = (
    "key",
    "name",
    "ref",
    "state",
    "keyless",
    "method",
    "url",
    "headers",
    "body",
    "status",
    "first_sent_at",
    "response_headers",
    "response_body",
)
#: The fields ``save()`` replaces; key, name and ref are fixed when an entry is first stored.
MUTABLE = FIELDS[3:]


def to_row(entry: JournalEntry) -> tuple[Any, ...]:
    """``entry`` as stored: the values of :data:`FIELDS` (headers as JSON, keyless as 0/1).
    A withheld credential is stored by its name alone, its value ``null``."""
    return (
        entry.key,
        entry.name,
        entry.ref,
        entry.state.value,
        int(entry.keyless),
        entry.method,
        entry.url,
        _pack(entry.headers, entry.withheld),
        entry.body,
        entry.status,
        entry.first_sent_at,
        _pack(entry.response_headers),
        entry.response_body,
    )


def from_row(row: Sequence[Any]) -> JournalEntry:
    """The entry stored as ``row`` (the values of :data:`FIELDS`, numbers maybe as text)."""
    (key, name, ref, state, keyless, method, url, headers, body, status, first_sent_at) = row[:11]
    response_headers, response_body = row[11:]
    kept, withheld = _unpack(headers)
    return JournalEntry(
        key=key,
        name=name,
        ref=ref,
        state=OperationState(state),
        method=method,
        url=url,
        headers=kept,
        withheld=withheld,
        body=bytes(body),
        status=None if status is None else int(status),
        keyless=bool(int(keyless)),
        first_sent_at=None if first_sent_at is None else float(first_sent_at),
        response_headers=_unpack(response_headers)[0],
        response_body=None if response_body is None else bytes(response_body),
    )


def _pack(headers: tuple[tuple[str, str], ...], withheld: tuple[str, ...] = ()) -> str:
    pairs: list[list[str | None]] = [[name, value] for name, value in headers]
    return json.dumps([*pairs, *([name, None] for name in withheld)])


def _unpack(text: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Headers as stored: those kept, and the names of credentials withheld (a credential an
    older version journaled in clear is withheld from now on, its value dropped)."""
    kept: list[tuple[str, str]] = []
    withheld: list[str] = []
    for name, value in json.loads(text):
        if value is None or is_credential(name):
            withheld.append(str(name))
        else:
            kept.append((str(name), str(value)))
    return tuple(kept), tuple(withheld)
