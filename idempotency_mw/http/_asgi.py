"""ASGI helpers: key parsing, the replayed request body, the response recorder, and replay."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Scope, Send

from idempotency_mw.values.records import StoredResponse
from idempotency_mw.wire.http import REPLAYED_HEADER
from idempotency_mw.wire.keys import MAX_KEY_LENGTH, is_valid_key, key_rule

#: ``Idempotent-Replayed: true``, as a replay sends it.
REPLAYED = (REPLAYED_HEADER.lower().encode(), b"true")
#: Statuses whose responses carry no body, so no Content-Length either.
_BODILESS = frozenset({204, 304})


def parse_key(raw: str) -> str | None:
    """The key from a header value, or ``None`` if it is not a valid key.

    A bare key is 1-255 visible ASCII characters; a value that opens with a double quote must
    be a Structured-Field string (``"abc"``, with ``\\"`` and ``\\\\`` escapes) and is unquoted.
    """
    if not raw.startswith('"'):
        return raw if is_valid_key(raw) else None
    key = _unquote_sf_string(raw[1:-1]) if len(raw) >= 2 and raw.endswith('"') else None
    if key is None or not 1 <= len(key) <= MAX_KEY_LENGTH:
        return None
    return key


def invalid_key_detail(header_name: str, raw: str) -> str:
    """Why ``raw``, which :func:`parse_key` refused, is not a key: for the 400 problem's detail."""
    if not raw.startswith('"'):
        return key_rule(header_name)
    if len(raw) < 2 or not raw.endswith('"') or _unquote_sf_string(raw[1:-1]) is None:
        return (
            f"{header_name} opens a quoted string that is broken: it must end with a double "
            'quote and hold printable ASCII only, with inner " and \\ escaped by a backslash'
        )
    return f"the quoted {header_name} must hold 1-{MAX_KEY_LENGTH} characters"


def _unquote_sf_string(quoted: str) -> str | None:
    chars: list[str] = []
    escaped = False
    for char in quoted:
        if not " " <= char <= "~":
            return None
        if escaped:
            if char not in '"\\':
                return None
            chars.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return None
        else:
            chars.append(char)
    return None if escaped else "".join(chars)


def request_headers(scope: Scope, names: frozenset[bytes]) -> dict[str, list[str]]:
    """The values of the request headers named in ``names`` (lower case, as ASGI gives them),
    read in one pass."""
    found: dict[str, list[str]] = {}
    for name, value in scope["headers"]:
        if name in names:
            found.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
    return found


class ReplayReceive:
    """Gives the app the body already read, then hands over to the server's ``receive``."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is None:
            return await self._receive()
        body, self._body = self._body, None
        return {"type": "http.request", "body": body, "more_body": False}


class ResponseRecorder:
    """Passes the response through unchanged while keeping a copy for the record.

    The copy keeps the headers ``records_header`` accepts and at most ``max_body`` bytes of body
    and ``max_headers`` bytes of headers; beyond that, or for a response sent in a way that
    cannot be replayed (a file sent by path, trailers), the response is marked not replayable.
    ``on_finish`` runs when the response's last message arrives, before it is passed on.
    """

    def __init__(
        self,
        send: Send,
        *,
        max_body: int,
        max_headers: int,
        records_header: Callable[[bytes], bool],
        on_finish: Callable[[ResponseRecorder], Awaitable[None]],
    ) -> None:
        self._send = send
        self._on_finish = on_finish
        self._max_body = max_body
        self._max_headers = max_headers
        self._records_header = records_header
        self._chunks: list[bytes] = []
        self._size = 0
        self.status: int | None = None
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.replayable = True
        #: Why the response cannot be replayed (for the log), when it cannot.
        self.unreplayable_reason = ""
        #: Whether it cannot be replayed for its size (over a limit).
        self.too_large = False
        self.finished = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            kept: list[tuple[bytes, bytes]] = []
            size = 0
            for name, value in message.get("headers", ()):
                if self._records_header(bytes(name).lower()):
                    kept.append((bytes(name), bytes(value)))
                    size += len(name) + len(value)
            self.headers = tuple(kept)
            if size > self._max_headers:
                self._refuse("its headers exceed max_header_bytes", too_large=True)
            if message.get("trailers", False):
                self._refuse("it has trailers")
        elif kind == "http.response.body":
            chunk: bytes = message.get("body", b"")
            if self.replayable:
                self._size += len(chunk)
                if self._size <= self._max_body:
                    self._chunks.append(chunk)
                else:
                    self._refuse("its body exceeds max_response_bytes", too_large=True)
            await self._pass_on(message, last=not message.get("more_body", False))
            return
        elif kind == "http.response.pathsend":
            # A file sent by path (FileResponse on servers with the extension) ends the response.
            self._refuse("it was sent as a file")
            await self._pass_on(message, last=True)
            return
        else:
            self._refuse(f"it was sent with {kind!r}")
        await self._send(message)

    async def _pass_on(self, message: Message, *, last: bool) -> None:
        if last:
            self.finished = True
            # Recorded before the client sees the end: a retry sent after the answer arrived is
            # replayed, never told the request is still in progress.
            await self._on_finish(self)
        await self._send(message)

    def _refuse(self, reason: str, *, too_large: bool = False) -> None:
        if self.replayable:
            self.replayable = False
            self.unreplayable_reason = reason
            self.too_large = too_large
            self._chunks.clear()

    def is_request_validation_error(self) -> bool:
        """Whether the response is a framework's answer to a request that failed validation
        (the endpoint never ran): FastAPI's 422 ``{"detail": [{"loc": ..., "msg": ...,
        "type": ...}, ...]}``, or Litestar's 400 ``{"status_code": 400, "detail": "Validation
        failed for POST /path", "extra": [{"message": ..., "key": ..., ...}, ...]}``."""
        if self.status not in (400, 422) or not self.replayable:
            return False
        try:
            answer = json.loads(b"".join(self._chunks))
        except ValueError:
            return False
        if not isinstance(answer, dict):
            return False
        if self.status == 422 and answer.keys() == {"detail"}:
            return _all_have(answer["detail"], {"loc", "msg", "type"})
        return (
            self.status == 400
            and answer.keys() == {"status_code", "detail", "extra"}
            and answer["status_code"] == 400
            and str(answer["detail"]).startswith("Validation failed for ")
            and _all_have(answer["extra"], {"message", "key"})
        )

    def stored_response(self) -> StoredResponse | None:
        """The response as it will be replayed, or ``None`` when it cannot be."""
        if not self.replayable or not self.finished or self.status is None:
            return None
        return StoredResponse(self.status, self.headers, b"".join(self._chunks))


def _all_have(entries: object, names: set[str]) -> bool:
    """Whether ``entries`` is a non-empty list of objects that each have ``names``."""
    return (
        isinstance(entries, list)
        and bool(entries)
        and all(isinstance(e, dict) and names <= e.keys() for e in entries)
    )


async def send_replay(send: Send, response: StoredResponse) -> None:
    """Send a recorded response, marked with exactly one ``Idempotent-Replayed: true``."""
    headers = [(name, value) for name, value in response.headers if name.lower() not in _OURS]
    if response.status >= 200 and response.status not in _BODILESS:
        headers.append((b"content-length", str(len(response.body)).encode()))
    headers.append(REPLAYED)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


#: Headers a replay sets itself, whatever a record holds.
_OURS = frozenset({b"content-length", REPLAYED[0]})
