"""The client's look at the server's record of an operation's key, through the middleware's
``lookup_path``: asked after an attempt's outcome was lost, before anything is sent again."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from idempotency_mw.client.values import JournalEntry
from idempotency_mw.values.records import KeyState
from idempotency_mw.wire.http import REPLAYED_HEADER

#: What the lookup's answer is when it tells nothing (it failed, or the server has none).
UNANSWERED = "unanswered"


@dataclass(frozen=True, slots=True)
class Learned:
    """What a lookup told: ``state`` (a :class:`~idempotency_mw.values.records.KeyState` value, or
    :data:`UNANSWERED`), the recorded ``status``, and the ``replay`` of the recorded answer
    when the server sent it."""

    state: str
    status: int | None = None
    replay: httpx.Response | None = None


def lookup_request(
    build: Callable[..., httpx.Request],
    entry: JournalEntry,
    lookup_path: str,
    timeout: httpx.Timeout,
) -> httpx.Request:
    """``GET <lookup_path>/<key>?replay=true`` on the operation's server, with its headers
    (the caller's credentials among them) but not its body's."""
    assert entry.url is not None
    url = httpx.URL(entry.url).join(f"{lookup_path}/{quote(entry.key, safe='')}")
    headers = [(n, v) for n, v in (*entry.headers, *entry.credentials) if n != "content-type"]
    return build("GET", url, params={"replay": "true"}, headers=headers, timeout=timeout)


def learned(outcome: httpx.Response | Exception) -> Learned:
    """What the lookup's ``outcome`` tells (:data:`UNANSWERED` for anything but a lookup's
    answer: the server may have no lookup, or be down)."""
    if not isinstance(outcome, httpx.Response):
        return Learned(UNANSWERED)
    if outcome.headers.get(REPLAYED_HEADER) == "true":
        return Learned(KeyState.COMPLETED.value, outcome.status_code, replay=outcome)
    if outcome.status_code != 200:
        return Learned(UNANSWERED)
    try:
        found = json.loads(outcome.content)
        state = KeyState(found["state"])
        status = found.get("status")
    except (ValueError, TypeError, KeyError):
        return Learned(UNANSWERED)
    return Learned(state.value, status if isinstance(status, int) else None)
