"""Multipart bodies are fingerprinted by their parts, never the boundary a client picks.

httpx (and every SDK built on it) picks a new random boundary for each request, so a byte
fingerprint made every retried upload a mismatch. Unit tests of the canonical form, then
uploads through the middleware in process, then the openai SDK retrying ``files.create``
against uvicorn.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Form, UploadFile

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.engine.fingerprint import form_parts, multipart_boundary, request_fingerprint
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for
from tests.support.faults import serve
from tests.support.sdk_server import Answers, file_service

pytestmark = pytest.mark.anyio

Files = dict[str, tuple[str, bytes, str]]


def fingerprint(content_type: str, body: bytes, **options: Any) -> str:
    return request_fingerprint(
        "POST", "/files", "/files", b"", [], body, content_type=content_type, **options
    )


def encoded(files: Files, data: dict[str, str] | None = None) -> tuple[str, bytes]:
    """The content type and body httpx sends for an upload (a new boundary each time)."""
    request = httpx.Request("POST", "http://testserver/files", files=files, data=data)
    return request.headers["content-type"], request.read()


def by_hand(*parts: bytes, boundary: str = "b0und", preamble: bytes = b"") -> tuple[str, bytes]:
    """A body framed by hand: each part is its header lines, CRLF CRLF, then its data."""
    delimiter = b"--" + boundary.encode()
    body = preamble + b"".join(delimiter + b"\r\n" + part + b"\r\n" for part in parts)
    return f"multipart/form-data; boundary={boundary}", body + delimiter + b"--\r\n"


UPLOAD: Files = {"file": ("notes.txt", b"hello, world", "text/plain")}
PLAIN_PART = b'Content-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nhello'


# ---------------------------------------------------------------- the canonical form


def test_the_same_upload_with_another_boundary_has_the_same_fingerprint() -> None:
    first, second = encoded(UPLOAD, {"purpose": "x"}), encoded(UPLOAD, {"purpose": "x"})
    assert first[0] != second[0]  # httpx picked two boundaries
    assert first[1] != second[1]
    assert fingerprint(*first) == fingerprint(*second)


def test_the_parts_are_name_filename_content_type_and_a_view_of_the_bytes() -> None:
    content_type, body = encoded(UPLOAD, {"purpose": "assistants"})
    boundary = multipart_boundary(content_type)
    assert boundary is not None
    parts = list(form_parts(body, boundary))
    assert [(p.name, p.filename, p.content_type, bytes(p.data)) for p in parts] == [
        (b"purpose", None, None, b"assistants"),
        (b"file", b"notes.txt", b"text/plain", b"hello, world"),
    ]
    assert all(isinstance(part.data, memoryview) for part in parts)


@pytest.mark.parametrize(
    "framing",
    [
        pytest.param(by_hand(PLAIN_PART, boundary="another"), id="boundary"),
        pytest.param(
            ('multipart/form-data; boundary="b0und"', by_hand(PLAIN_PART)[1]),
            id="quoted-boundary",
        ),
        pytest.param(
            by_hand(b'content-disposition: form-data; filename="a.txt"; name=file\r\n\r\nhello'),
            id="header-case-parameter-order-token",
        ),
        pytest.param(
            by_hand(b"X-Extra: 1\r\n" + PLAIN_PART, preamble=b"ignored\r\n"), id="preamble"
        ),
        pytest.param(
            ("multipart/form-data; boundary=b0und", by_hand(PLAIN_PART)[1] + b"epilogue"),
            id="epilogue",
        ),
    ],
)
def test_framing_does_not_enter_the_fingerprint(framing: tuple[str, bytes]) -> None:
    assert fingerprint(*framing) == fingerprint(*by_hand(PLAIN_PART))


def test_header_order_and_transport_padding_are_framing() -> None:
    typed = b'Content-Disposition: form-data; name="f"\r\nContent-Type: text/csv\r\n\r\n1,2'
    reordered = b'CONTENT-TYPE:text/csv\r\nContent-Disposition:form-data;name="f"\r\n\r\n1,2'
    content_type, body = by_hand(typed)
    padded = body.replace(b"--b0und\r\n", b"--b0und  \t\r\n", 1)
    assert fingerprint(*by_hand(typed)) == fingerprint(*by_hand(reordered))
    assert fingerprint(content_type, padded) == fingerprint(content_type, body)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"file": ("notes.txt", b"hello, World", "text/plain")}, id="file"),
        pytest.param({"file": ("other.txt", b"hello, world", "text/plain")}, id="filename"),
        pytest.param({"file": ("notes.txt", b"hello, world", "text/csv")}, id="content-type"),
        pytest.param({"upload": ("notes.txt", b"hello, world", "text/plain")}, id="name"),
    ],
)
def test_other_content_is_another_fingerprint(other: Files) -> None:
    assert fingerprint(*encoded(UPLOAD)) != fingerprint(*encoded(other))


def test_another_field_value_or_part_order_is_another_fingerprint() -> None:
    same = fingerprint(*encoded(UPLOAD, {"purpose": "x"}))
    assert same != fingerprint(*encoded(UPLOAD, {"purpose": "y"}))
    first = b'Content-Disposition: form-data; name="a"\r\n\r\n1'
    second = b'Content-Disposition: form-data; name="b"\r\n\r\n2'
    assert fingerprint(*by_hand(first, second)) != fingerprint(*by_hand(second, first))


def test_an_absent_filename_or_content_type_is_not_an_empty_one() -> None:
    bare = b'Content-Disposition: form-data; name="f"\r\n\r\nx'
    empty_name = b'Content-Disposition: form-data; name="f"; filename=""\r\n\r\nx'
    empty_type = b'Content-Disposition: form-data; name="f"\r\nContent-Type:\r\n\r\nx'
    digests = {fingerprint(*by_hand(part)) for part in (bare, empty_name, empty_type)}
    assert len(digests) == 3


def test_an_extended_filename_takes_precedence() -> None:
    extended = (
        b'Content-Disposition: form-data; name="file"; filename="a.txt"; '
        b"filename*=UTF-8''%C3%A4.txt\r\n\r\nhello"
    )
    assert fingerprint(*by_hand(extended)) != fingerprint(*by_hand(PLAIN_PART))


def test_multipart_enters_by_content_whatever_the_mode() -> None:
    upload = encoded(UPLOAD)
    assert fingerprint(*upload, mode="json") == fingerprint(*encoded(UPLOAD))


def test_a_form_never_shares_a_digest_with_a_bytes_body() -> None:
    content_type, body = by_hand(PLAIN_PART)
    assert fingerprint(content_type, body) != fingerprint("", body)
    assert fingerprint(content_type, b"--b0und--") != fingerprint("", b"")  # no parts


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        pytest.param("multipart/form-data", by_hand(PLAIN_PART)[1], id="no-boundary"),
        pytest.param("multipart/form-data; boundary=", by_hand(PLAIN_PART)[1], id="empty"),
        pytest.param(
            "multipart/form-data; boundary=" + "b" * 71, by_hand(PLAIN_PART)[1], id="too-long"
        ),
        pytest.param(by_hand(PLAIN_PART)[0], by_hand(PLAIN_PART)[1][:-9], id="no-closing"),
        pytest.param(by_hand(PLAIN_PART)[0], b"garbage", id="garbage"),
        pytest.param(by_hand(PLAIN_PART)[0], b"", id="empty-body"),
        pytest.param(*by_hand(b"Content-Type: text/plain\r\n\r\nhello"), id="no-disposition"),
        pytest.param(*by_hand(b"Content-Disposition: form-data\r\n\r\nhello"), id="no-name"),
        pytest.param(*by_hand(b"Content-Disposition: form-data; name=a\r\nx"), id="no-end"),
        pytest.param(*by_hand(b"not a header\r\n\r\nhello"), id="header-line"),
        pytest.param(
            by_hand(PLAIN_PART)[0],
            by_hand(PLAIN_PART)[1].replace(b"\r\n", b"\n"),
            id="bare-newlines",
        ),
        pytest.param(
            by_hand(PLAIN_PART)[0],
            by_hand(PLAIN_PART)[1].replace(b"--b0und\r\n", b"--b0undX\r\n", 1),
            id="boundary-prefix",
        ),
    ],
)
def test_a_malformed_form_enters_as_bytes(content_type: str, body: bytes) -> None:
    assert fingerprint(content_type, body) == fingerprint("", body)


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/x-www-form-urlencoded", "multipart/mixed"]
)
def test_other_content_types_keep_the_bytes_digest(content_type: str) -> None:
    # The digest without a content type is the one stored records hold (pinned in
    # tests/middleware/test_middleware.py); no other content type changes it.
    body = b'{"sku": "A-1"}'
    assert fingerprint(content_type, body) == fingerprint("", body)


def test_a_large_upload_is_hashed_without_a_copy() -> None:
    size = 8 << 20
    content_type, body = encoded({"file": ("big.bin", b"\x01" * size, "application/zip")})
    tracemalloc.start()
    try:
        fingerprint(content_type, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size // 16, f"fingerprinting an {size}-byte upload allocated {peak} bytes"


# ---------------------------------------------------------------- through the middleware


def upload_service(**options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)
    stored: list[tuple[str | None, bytes, str]] = []
    app.state.stored = stored

    @app.post("/files", status_code=201)
    async def upload(file: UploadFile, purpose: str = Form()) -> dict[str, Any]:
        stored.append((file.filename, await file.read(), purpose))
        return {"id": len(stored), "filename": file.filename}

    return app


KEY = {"Idempotency-Key": "upload-1"}


@pytest.mark.parametrize("mode", ["bytes", "json"])
async def test_a_retried_upload_runs_once_and_is_replayed(mode: str) -> None:
    app = upload_service(fingerprint=mode)
    async with client_for(app) as client:
        first = await client.post("/files", files=UPLOAD, data={"purpose": "a"}, headers=KEY)
        again = await client.post("/files", files=UPLOAD, data={"purpose": "a"}, headers=KEY)
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() == {"id": 1, "filename": "notes.txt"}
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert app.state.stored == [("notes.txt", b"hello, world", "a")]


@pytest.mark.parametrize(
    ("files", "purpose"),
    [
        pytest.param({"file": ("notes.txt", b"other bytes", "text/plain")}, "a", id="file"),
        pytest.param({"file": ("other.txt", b"hello, world", "text/plain")}, "a", id="filename"),
        pytest.param(UPLOAD, "b", id="field"),
    ],
)
async def test_another_upload_under_the_key_is_a_mismatch(files: Files, purpose: str) -> None:
    app = upload_service()
    async with client_for(app) as client:
        first = await client.post("/files", files=UPLOAD, data={"purpose": "a"}, headers=KEY)
        other = await client.post("/files", files=files, data={"purpose": purpose}, headers=KEY)
    assert first.status_code == 201
    assert other.status_code == 409
    assert other.json()["type"] == "urn:idempotency-mw:problem:mismatch"
    assert len(app.state.stored) == 1


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        pytest.param("multipart/form-data", b"garbage", id="no-boundary"),
        pytest.param("multipart/form-data; boundary=b0und", b"garbage", id="garbage"),
        pytest.param("multipart/form-data; boundary=b0und", b"--b0und\r\nx", id="no-closing"),
    ],
)
async def test_a_malformed_form_is_the_apps_to_refuse(content_type: str, body: bytes) -> None:
    app = upload_service()
    headers = {**KEY, "Content-Type": content_type}
    async with client_for(app) as client:
        answer = await client.post("/files", content=body, headers=headers)
    assert answer.status_code in (400, 422), answer.text
    assert "idempotency-mw" not in answer.text
    assert app.state.stored == []


# ---------------------------------------------------------------- the openai SDK under uvicorn

#: The SDK's own timeout: the first attempt's answer comes later, so the SDK retries.
SDK_TIMEOUT = 0.5


async def late_first_answer(number: int, content: bytes) -> None:
    if number == 1:
        await asyncio.sleep(SDK_TIMEOUT * 4)  # this answer comes after the SDK gave up


async def test_the_openai_sdk_retrying_an_upload_gets_it_stored_once() -> None:
    runs: list[bytes] = []
    answers = Answers()
    app = file_service(runs, late_first_answer)
    async with serve(answers.around(app)) as url:
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="test", max_retries=4, timeout=SDK_TIMEOUT
        )
        async with client:
            raw = await client.files.with_raw_response.create(
                file=("notes.txt", b"hello, world", "text/plain"),
                purpose="assistants",
                # The SDK mints no key of its own: one per operation, sent on every attempt.
                extra_headers={"Idempotency-Key": "upload-1"},
            )
    assert raw.parse().id == "file-1"
    assert raw.headers["idempotent-replayed"] == "true"
    assert runs == [b"hello, world"]
    # The first answer (lost: the SDK gave up on it), at least one 409 in progress, the replay.
    statuses = answers.statuses
    assert statuses.count(200) == 2, statuses
    assert statuses[-1] == 200, statuses
    assert 409 in statuses, statuses
