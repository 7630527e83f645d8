"""What needs a person, as rows for the ``idempotency-mw journal attention`` command."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from idempotency_mw.client.journals import Journal, needing_attention
from idempotency_mw.client.protocol import key_digest


@dataclass(frozen=True, slots=True)
class AttentionRow:
    """One operation a person has to look at. ``key`` is a digest of its key (keys are
    never printed); ``first_sent`` is UTC, ``''`` when it was never sent."""

    state: str
    name: str
    ref: str
    status: str
    first_sent: str
    key: str

    HEADER = ("state", "name", "ref", "status", "first sent (UTC)", "key digest")


def attention_rows(journal: Journal) -> list[AttentionRow]:
    """The journal's operations marked ``needs_confirmation`` or ``needs_intervention``."""
    return [
        AttentionRow(
            state=entry.state.value,
            name=entry.name,
            ref=entry.ref or "",
            status="" if entry.status is None else str(entry.status),
            first_sent=_utc(entry.first_sent_at),
            key=key_digest(entry.key),
        )
        for entry in needing_attention(journal)
    ]


def format_rows(rows: list[AttentionRow]) -> str:
    """``rows`` as an aligned table under a header."""
    table = [
        AttentionRow.HEADER,
        *((r.state, r.name, r.ref, r.status, r.first_sent, r.key) for r in rows),
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(AttentionRow.HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


def _utc(timestamp: float | None) -> str:
    if timestamp is None:
        return ""
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")
