"""A retry signed anew is the same caller's: Azure's access-key clients and AWS SigV4 sign every
attempt over its time, so a record is bound to their key id, never to the signature.

Under uvicorn, the first attempt runs and its answer is lost (a gateway's 503, ``Retry-After:
1``): the retry is signed a second later, with another date and signature, and must be
replayed; a request signed with another key id must still get 409 credential-mismatch.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid
from collections.abc import Callable, Generator
from datetime import UTC, datetime
from email.utils import formatdate
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
import httpx
import pytest
from azure.core.pipeline import Pipeline, PipelineRequest
from azure.core.pipeline.policies import RetryPolicy, SansIOHTTPPolicy
from azure.core.pipeline.transport import RequestsTransport
from azure.core.rest import HttpRequest
from fastapi import FastAPI, Request

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from tests.support.faults import serve

pytestmark = pytest.mark.anyio

CREDENTIAL_MISMATCH = "urn:idempotency-mw:problem:credential-mismatch"


def message_service(runs: list[str]) -> FastAPI:
    """``POST /messages`` answers the message it created, behind the middleware."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

    @app.post("/messages", status_code=202)
    async def send_message(request: Request) -> dict[str, Any]:
        runs.append((await request.json())["text"])
        return {"id": f"message-{len(runs)}"}

    return app


class FirstAnswerLost:
    """Runs every request; the first answer is lost on the way, a gateway answering 503 with
    ``Retry-After: 1`` instead. Notes each request's ``Authorization``."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.signed: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.signed.append(headers.get(b"authorization", b"").decode())
        if len(self.signed) > 1:
            await self.app(scope, receive, send)
            return

        async def lost(message: Any) -> None:
            pass

        await self.app(scope, receive, lost)
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"retry-after", b"1"), (b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})


class AccessKeySigning(SansIOHTTPPolicy[Any, Any]):
    """Signs each attempt as Azure's access-key clients do: an HMAC-SHA256 of the method, path
    and query, ``x-ms-date``, host and the body's hash. Azure Communication sends no key id;
    Azure App Configuration sends it as ``Credential=``."""

    def __init__(self, secret: bytes, credential: str | None = None) -> None:
        self.secret = secret
        self.credential = credential

    def on_request(self, request: PipelineRequest[Any]) -> None:
        http = request.http_request
        url = urlsplit(http.url)
        body = http.content if isinstance(http.content, bytes) else b""
        date = formatdate(usegmt=True)
        content_hash = base64.b64encode(hashlib.sha256(body).digest()).decode()
        signed = f"{http.method}\n{url.path}?{url.query}\n{date};{url.netloc};{content_hash}"
        mac = hmac.new(self.secret, signed.encode(), hashlib.sha256).digest()
        credential = "" if self.credential is None else f"Credential={self.credential}&"
        http.headers["x-ms-date"] = date
        http.headers["x-ms-content-sha256"] = content_hash
        http.headers["Authorization"] = (
            f"HMAC-SHA256 {credential}SignedHeaders=x-ms-date;host;x-ms-content-sha256"
            f"&Signature={base64.b64encode(mac).decode()}"
        )


def azure_send(url: str, signing: AccessKeySigning, request_id: str) -> tuple[int, Any]:
    """One operation through azure-core's pipeline (its retry policy, then the signing, as
    Azure's SDKs order them), sent with the OASIS headers Azure's clients send."""
    pipeline: Pipeline[Any, Any] = Pipeline(
        transport=RequestsTransport(),
        policies=[RetryPolicy(retry_total=2), signing],
    )
    request = HttpRequest(
        "POST",
        f"{url}/messages",
        json={"text": "hello"},
        headers={
            "Repeatability-Request-ID": request_id,
            "Repeatability-First-Sent": formatdate(usegmt=True),
        },
    )
    with pipeline:
        response = pipeline.run(request).http_response
        response.read()
        return response.status_code, response.json()


@pytest.mark.parametrize("credential", [None, "key-id-1"], ids=["communication", "app-config"])
async def test_an_azure_access_key_retry_signed_a_second_later_is_replayed(
    credential: str | None,
) -> None:
    runs: list[str] = []
    layer = FirstAnswerLost(message_service(runs))
    request_id = str(uuid.uuid4())
    async with serve(layer) as url:
        signing = AccessKeySigning(b"the access key", credential)
        status, body = await anyio.to_thread.run_sync(azure_send, url, signing, request_id)
    first, retry = layer.signed
    assert first != retry  # signed anew, over another second
    assert (status, body) == (202, {"id": "message-1"})
    assert runs == ["hello"]


async def test_an_azure_request_signed_with_another_key_id_is_refused() -> None:
    runs: list[str] = []
    layer = FirstAnswerLost(message_service(runs))
    request_id = str(uuid.uuid4())
    async with serve(layer) as url:
        mine = AccessKeySigning(b"the access key", "key-id-1")
        await anyio.to_thread.run_sync(azure_send, url, mine, request_id)
        theirs = AccessKeySigning(b"the access key", "key-id-2")
        status, body = await anyio.to_thread.run_sync(azure_send, url, theirs, request_id)
    assert status == 409
    assert body["type"] == CREDENTIAL_MISMATCH
    assert runs == ["hello"]


class SigV4(httpx.Auth):
    """AWS Signature Version 4, as AWS documents it (header-based, the payload hashed), at the
    time ``now()`` says: every request is signed anew."""

    def __init__(
        self, key_id: str, secret: str, now: Callable[[], datetime], region: str = "eu-west-1"
    ) -> None:
        self.key_id, self.secret, self.now, self.region = key_id, secret, now, region

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        moment = self.now()
        stamp, day = moment.strftime("%Y%m%dT%H%M%SZ"), moment.strftime("%Y%m%d")
        payload = hashlib.sha256(request.content).hexdigest()
        request.headers["x-amz-date"] = stamp
        request.headers["x-amz-content-sha256"] = payload
        names = ["host", "x-amz-content-sha256", "x-amz-date"]
        canonical = "\n".join(
            [
                request.method,
                request.url.raw_path.decode().partition("?")[0],
                request.url.query.decode(),
                *(f"{name}:{request.headers[name].strip()}" for name in names),
                "",
                ";".join(names),
                payload,
            ]
        )
        scope = f"{day}/{self.region}/execute-api/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = f"AWS4{self.secret}".encode()
        for part in (day, self.region, "execute-api", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        request.headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.key_id}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        yield request


async def test_a_sigv4_retry_signed_the_next_day_is_replayed_and_another_key_id_is_refused() -> (
    None
):
    runs: list[str] = []
    layer = FirstAnswerLost(message_service(runs))
    # The first attempt is signed a second before midnight (UTC), the retry after it: its
    # credential scope names the next day.
    times = iter([datetime(2026, 12, 7, 23, 59, 59, tzinfo=UTC), datetime(2026, 12, 8, tzinfo=UTC)])
    mine = SigV4("AKIDEXAMPLE1", "secret-1", lambda: next(times))
    theirs = SigV4("AKIDEXAMPLE2", "secret-1", lambda: datetime(2026, 12, 8, tzinfo=UTC))
    headers = {"Idempotency-Key": "order-17"}
    async with serve(layer) as url, httpx.AsyncClient(base_url=url) as client:
        lost = await client.post("/messages", json={"text": "hello"}, headers=headers, auth=mine)
        retry = await client.post("/messages", json={"text": "hello"}, headers=headers, auth=mine)
        other = await client.post("/messages", json={"text": "hello"}, headers=headers, auth=theirs)
    first, again, _ = layer.signed
    assert "Credential=AKIDEXAMPLE1/20261207/" in first
    assert "Credential=AKIDEXAMPLE1/20261208/" in again
    assert lost.status_code == 503
    assert retry.status_code == 202
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == {"id": "message-1"}
    assert other.status_code == 409
    assert other.json()["type"] == CREDENTIAL_MISMATCH
    assert runs == ["hello"]
