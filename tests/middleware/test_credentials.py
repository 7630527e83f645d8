"""Records are bound to the caller's credentials by default: a key never crosses callers."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request

from idempotency_mw import IdempotencyMiddleware, Store
from idempotency_mw.wire.credentials import credential_digest
from tests.support.apps import client_for

pytestmark = pytest.mark.anyio


def service(store: Store, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    app.state.runs = 0

    @app.post("/notes", status_code=201)
    async def create(request: Request) -> dict[str, Any]:
        app.state.runs += 1
        return {"run": app.state.runs, "owner": request.headers.get("authorization", "")}

    return app


def headers(key: str, **extra: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **extra}


async def test_another_callers_credentials_never_get_the_record(store: Store) -> None:
    app = service(store)
    alice = {"Authorization": "Bearer alice"}
    async with client_for(app) as client:
        first = await client.post("/notes", json={"n": 1}, headers=headers("k", **alice))
        bob = await client.post(
            "/notes", json={"n": 1}, headers=headers("k", Authorization="Bearer bob")
        )
        anonymous = await client.post("/notes", json={"n": 1}, headers=headers("k"))
        again = await client.post("/notes", json={"n": 1}, headers=headers("k", **alice))
    assert first.status_code == 201
    for other in (bob, anonymous):
        assert other.status_code == 409
        assert other.json()["type"] == "urn:idempotency-mw:problem:credential-mismatch"
        assert "alice" not in other.text
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.runs == 1


async def test_api_key_headers_are_credentials_by_default(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        await client.post("/notes", headers=headers("k", **{"X-Goog-Api-Key": "a"}))
        other = await client.post("/notes", headers=headers("k", **{"X-Goog-Api-Key": "b"}))
        vendor = await client.post("/notes", headers=headers("v", **{"X-Acme-Token": "a"}))
        other_vendor = await client.post("/notes", headers=headers("v", **{"X-Acme-Token": "b"}))
    assert other.json()["type"].endswith("credential-mismatch")
    assert other_vendor.json()["type"].endswith("credential-mismatch")
    assert vendor.status_code == 201
    assert app.state.runs == 2


async def test_with_scope_the_scope_decides(store: Store) -> None:
    app = service(store, scope=lambda connection: connection.headers.get("x-user", "anon"))
    async with client_for(app) as client:
        await client.post(
            "/notes", headers=headers("k", Authorization="Bearer old", **{"X-User": "alice"})
        )
        # A rotated token of the same user keeps replaying under scope=.
        rotated = await client.post(
            "/notes", headers=headers("k", Authorization="Bearer new", **{"X-User": "alice"})
        )
    assert rotated.headers["idempotent-replayed"] == "true"
    assert app.state.runs == 1


async def test_credential_headers_and_cookies_are_configurable(store: Store) -> None:
    app = service(store, credential_headers=["X-Api-Key"], credential_cookies=["session"])
    async with client_for(app) as client:
        await client.post(
            "/notes", headers=headers("k", **{"X-Api-Key": "a", "Cookie": "session=1"})
        )
        other_cookie = await client.post(
            "/notes", headers=headers("k", **{"X-Api-Key": "a", "Cookie": "session=2"})
        )
        other_key = await client.post(
            "/notes", headers=headers("k", **{"X-Api-Key": "b", "Cookie": "session=1"})
        )
        # Authorization is no credential here, and other cookies do not count.
        same = await client.post(
            "/notes",
            headers=headers(
                "k", **{"X-Api-Key": "a", "Cookie": "session=1; theme=dark", "Authorization": "x"}
            ),
        )
    assert other_cookie.json()["type"].endswith("credential-mismatch")
    assert other_key.json()["type"].endswith("credential-mismatch")
    assert same.headers["idempotent-replayed"] == "true"
    assert app.state.runs == 1


async def test_header_lists_given_as_one_shot_iterables_still_count(store: Store) -> None:
    # A generator can be read once: the middleware must not read it twice and lose it.
    app = service(
        store,
        credential_headers=(name for name in ["X-Api-Key"]),
        fingerprint_headers=iter(["X-Tenant"]),
    )
    async with client_for(app) as client:
        first = {"X-Api-Key": "a", "X-Tenant": "acme"}
        await client.post("/notes", headers=headers("k", **first))
        other_key = await client.post("/notes", headers=headers("k", **{**first, "X-Api-Key": "b"}))
        other_tenant = await client.post(
            "/notes", headers=headers("k", **{**first, "X-Tenant": "beta"})
        )
    assert other_key.json()["type"].endswith("credential-mismatch")
    assert other_tenant.json()["type"].endswith("mismatch")
    assert not other_tenant.json()["type"].endswith("credential-mismatch")
    assert app.state.runs == 1


@pytest.mark.parametrize(
    ("first", "retry", "same"),
    [
        ("Bearer abc", "Bearer abc", True),
        ("Bearer abc", "Bearer abd", False),
        ("Basic YTpi", "Basic YTpj", False),
        (
            "AWS4-HMAC-SHA256 Credential=AKID/20261207/eu-west-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=0a",
            "AWS4-HMAC-SHA256 Credential=AKID/20261208/eu-west-1/s3/aws4_request, "
            "SignedHeaders=host;x-amz-date, Signature=1b",
            True,
        ),
        (
            "AWS4-HMAC-SHA256 Credential=AKID/20261207/eu-west-1/s3/aws4_request, Signature=0a",
            "AWS4-HMAC-SHA256 Credential=AKIE/20261207/eu-west-1/s3/aws4_request, Signature=0a",
            False,
        ),
        ("HMAC-SHA256 SignedHeaders=x-ms-date&Signature=a=", "HMAC-SHA256 Signature=b=", True),
        ('Signature keyId="k1",signature="a"', 'Signature keyId="k1",signature="b"', True),
        ('Signature keyId="k1",signature="a"', 'Signature keyId="k2",signature="a"', False),
        ("SharedKey account:c2ln", "SharedKey account:b3RoZXI=", True),
        ("SharedKey account:c2ln", "SharedKey other:c2ln", False),
    ],
)
def test_a_credential_is_bound_by_what_stays_the_same_across_retries(
    first: str, retry: str, same: bool
) -> None:
    digests = {credential_digest([("authorization", value)]) for value in (first, retry)}
    assert (len(digests) == 1) is same
