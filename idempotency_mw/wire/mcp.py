"""What both halves say over MCP: the ``_meta`` names of a keyed tool call and the lookup
method's params and result. Needs the ``[mcp]`` extra."""

from __future__ import annotations

from typing import Any

from mcp_types import RequestParams, Result

#: Where a call carries its key: ``params._meta[META_KEY]``.
META_KEY = "idempotencyKey"
#: Where a call says when its caller first sent it: an HTTP-date or an RFC 3339 date-time.
FIRST_SENT_META = "idempotencyFirstSent"
#: Set in the ``_meta`` of a result that was replayed rather than run.
REPLAYED_META = "idempotencyReplayed"
#: Set in the ``_meta`` of the ``isError`` result of a tool that crashed: nothing was recorded
#: and its key is free, so the same call may be sent again under it (an HTTP 500).
RETRY_META = "idempotencyRetry"
#: The request method that looks a key up: :class:`LookupParams` answered by a
#: :class:`KeyLookupResult`, for the caller the key is bound to.
LOOKUP_METHOD = "idempotency/lookup"


class LookupParams(RequestParams):
    """The params of :data:`LOOKUP_METHOD`: the key to look up."""

    key: str


class KeyLookupResult(Result):
    """What :data:`LOOKUP_METHOD` answers: what the middleware's lookup answers over HTTP
    (see :func:`~idempotency_mw.wire.lookup.state_json`), its names in camelCase on the wire,
    and the recorded tool result as a retry would get it replayed (``result``), when there is
    one.
    """

    state: str
    expires_at: str | None = None
    lease_until: str | None = None
    status: int | None = None
    replayable: bool | None = None
    result: dict[str, Any] | None = None
