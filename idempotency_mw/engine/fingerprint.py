"""The request fingerprint: what must match for a repeated key to be the same request.

A body enters it as its bytes, as canonical JSON (``fingerprint="json"``), or, for
``multipart/form-data``, as its parts: each part's name, filename, content type and bytes, in
order. The boundary, the part headers' order and case and a preamble or epilogue are framing
(httpx picks a new boundary for every request), so they never enter it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hashlib import _Hash

    from idempotency_mw.values.settings import FingerprintMode

#: In place of the body's length: the multipart form follows. No body is this long, so no
#: bytes body shares a digest with a multipart one.
_MULTIPART = (1 << 64) - 1
_ABSENT = (1 << 64) - 1
#: Part headers longer than this make the body malformed (they are copied to be parsed).
_MAX_PART_HEADERS = 1 << 14


def request_fingerprint(
    method: str,
    route: str,
    path: str,
    query: bytes,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    content_type: str = "",
    mode: FingerprintMode = "bytes",
) -> str:
    """Hex SHA-256 over length-prefixed fields, so no two field splits share a hash.

    A ``multipart/form-data`` body (by ``content_type``) enters by its parts whatever the
    ``mode``; a malformed one enters as bytes (the app refuses it itself). With ``mode="json"``
    a JSON body enters as canonical JSON; any other body enters as its bytes.
    """
    head = [_framed(field) for field in (method.encode(), route.encode(), path.encode(), query)]
    head.append(len(headers).to_bytes(8, "big"))
    for name, value in headers:
        head += (_framed(name.encode("latin-1")), _framed(value.encode("latin-1")))
    digest = hashlib.sha256(b"".join(head))
    boundary = multipart_boundary(content_type)
    if boundary is not None:
        by_parts = digest.copy()
        by_parts.update(_MULTIPART.to_bytes(8, "big"))
        try:
            for part in form_parts(body, boundary):
                part.feed(by_parts)
        except MalformedMultipart:
            pass
        else:
            return by_parts.hexdigest()
    elif mode == "json":
        canonical = canonical_json(body)
        body = body if canonical is None else canonical
    digest.update(len(body).to_bytes(8, "big"))
    digest.update(body)
    return digest.hexdigest()


def _framed(value: bytes) -> bytes:
    return len(value).to_bytes(8, "big") + value


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


class MalformedMultipart(ValueError):
    """The body is not the ``multipart/form-data`` its content type says."""


@dataclass(frozen=True, slots=True)
class FormPart:
    """One part of a form: what of it is content. ``data`` is a view into the body."""

    name: bytes
    filename: bytes | None
    content_type: bytes | None
    data: memoryview

    def feed(self, digest: _Hash) -> None:
        """Add the part to ``digest``, length-prefixed, an absent field apart from an empty one."""
        for field in (self.name, self.filename, self.content_type):
            if field is None:
                digest.update(_ABSENT.to_bytes(8, "big"))
            else:
                digest.update(_framed(field))
        digest.update(len(self.data).to_bytes(8, "big"))
        digest.update(self.data)


def multipart_boundary(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type; ``None`` for another type, or
    when the boundary is missing or not one RFC 2046 allows (the body then enters as bytes)."""
    media_type, _, parameters = content_type.partition(";")
    if media_type.strip().lower() != "multipart/form-data":
        return None
    boundary = _parameters(parameters.encode("latin-1", "replace")).get(b"boundary")
    if boundary is None or not 0 < len(boundary) <= 70 or boundary.endswith(b" "):
        return None
    return boundary


def form_parts(body: bytes, boundary: bytes) -> Iterator[FormPart]:
    """The parts of a ``multipart/form-data`` body, in order, as views into ``body`` (never
    copies). Raises :class:`MalformedMultipart` where the body breaks RFC 7578's framing (a
    part with no form-data name, no closing delimiter); a preamble and an epilogue are skipped.
    """
    delimiter = b"\r\n--" + boundary
    view = memoryview(body)
    # The first delimiter may open the body, without the CRLF that precedes the others.
    if body.startswith(delimiter[2:]):
        position = len(delimiter) - 2
    elif (position := body.find(delimiter)) >= 0:
        position += len(delimiter)
    else:
        raise MalformedMultipart("no delimiter")
    while True:
        if body.startswith(b"--", position):
            return  # the close delimiter: what follows is the epilogue
        position = _line_end(body, position)
        name, filename, content_type, position = _part_headers(body, position)
        end = body.find(delimiter, position)
        if end < 0:
            raise MalformedMultipart("no closing delimiter")
        yield FormPart(name, filename, content_type, view[position:end])
        position = end + len(delimiter)


def _line_end(body: bytes, position: int) -> int:
    """Past the rest of a delimiter line: transport padding (spaces, tabs), then CRLF."""
    end = body.find(b"\r\n", position, position + _MAX_PART_HEADERS)
    if end < 0 or body[position:end].strip(b" \t"):
        raise MalformedMultipart("a delimiter line does not end in CRLF")
    return end + 2


def _part_headers(body: bytes, position: int) -> tuple[bytes, bytes | None, bytes | None, int]:
    """A part's name, filename, content type, and where its data begins."""
    limit = position + _MAX_PART_HEADERS
    headers: dict[bytes, bytes] = {}
    while True:
        end = body.find(b"\r\n", position, limit)
        if end < 0:
            raise MalformedMultipart("part headers do not end with an empty line")
        if end == position:
            break
        name, colon, value = body[position:end].partition(b":")
        if not colon or not name.strip():
            raise MalformedMultipart("a part header line is not a header")
        headers[name.strip().lower()] = value.strip()
        position = end + 2
    disposition, _, parameters = headers.get(b"content-disposition", b"").partition(b";")
    if disposition.strip().lower() != b"form-data":
        raise MalformedMultipart("a part is not form-data")
    names = _parameters(parameters)
    if b"name" not in names:
        raise MalformedMultipart("a part has no name")
    # RFC 6266: an extended filename* (RFC 8187) takes precedence over filename.
    filename = names.get(b"filename*", names.get(b"filename"))
    return names[b"name"], filename, headers.get(b"content-type"), end + 2


def _parameters(text: bytes) -> dict[bytes, bytes]:
    """``; name=value`` parameters (a token, or a quoted string unquoted), names lowercased;
    the first of a repeated name counts."""
    found: dict[bytes, bytes] = {}
    position, size = 0, len(text)
    while position < size:
        end = position
        while end < size and text[end] not in b"=;":
            end += 1
        name = text[position:end].strip(b" \t").lower()
        if end == size or text[end] == ord(";"):
            position = end + 1  # a parameter without a value
            continue
        position = end + 1
        while position < size and text[position] in b" \t":
            position += 1
        value = bytearray()
        if text.startswith(b'"', position):
            position += 1
            while position < size and text[position] != ord('"'):
                if text[position] == ord("\\"):
                    position += 1
                value += text[position : position + 1]
                position += 1
            end = text.find(b";", position)
        else:
            end = text.find(b";", position)
            value += text[position : size if end < 0 else end].strip(b" \t")
        found.setdefault(name, bytes(value))
        position = size if end < 0 else end + 1
    return found
