"""After a timeout, over HTTP on SQLite, PostgreSQL and Redis: the lookup by key, the refusal
of a retry older than the route's retention, and the retention each keyed answer states."""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime
from email.utils import formatdate, parsedate_to_datetime
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from idempotency_mw import IdempotencyMiddleware, Store, idempotent
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.outcome import FIRST_SENT_SKEW
from tests.support.apps import Gate, client_for

pytestmark = pytest.mark.anyio

RETENTION = 2.0
EXPIRED_KEY = "urn:idempotency-mw:problem:expired-key"


@pytest.fixture
def store(backend_store: Store) -> Store:
    """SQLite, PostgreSQL and Redis in turn."""
    return backend_store


def service(store: Store, **options: Any) -> FastAPI:
    """Orders with a 2 s retention (the effect counted in ``app.state.runs``), and a route
    held by ``app.state.gate``."""
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store=store, lookup_path="/idempotency-keys", **options
    )
    runs: Counter[str] = Counter()
    app.state.runs = runs
    app.state.gate = Gate()

    @app.post("/orders", status_code=201)
    @idempotent(ttl=RETENTION, lease=RETENTION / 2)
    async def order(body: dict[str, Any]) -> dict[str, Any]:
        runs["orders"] += 1
        return {"order": runs["orders"], **body}

    @app.post("/held")
    async def held() -> dict[str, int]:
        runs["held"] += 1
        app.state.gate.entered.set()
        await app.state.gate.opened.wait()
        return {"run": runs["held"]}

    return app


def http_date(seconds: float) -> str:
    return formatdate(seconds, usegmt=True)


def expires(response: httpx.Response) -> float:
    return parsedate_to_datetime(response.headers["idempotency-key-expires"]).timestamp()


async def test_a_lookup_tells_the_caller_its_completed_answer(store: Store) -> None:
    app = service(store)
    alice = {"Authorization": "Bearer alice", "Idempotency-Key": "k-1"}
    async with client_for(app) as client:
        first = await client.post("/orders", json={"n": 1}, headers=alice)
        assert first.status_code == 201
        found = await client.get("/idempotency-keys/k-1", headers={"Authorization": "Bearer alice"})
        assert found.status_code == 200
        state = found.json()
        assert state["state"] == "completed"
        assert (state["status"], state["replayable"]) == (201, True)
        assert found.headers["cache-control"] == "no-store"
        # The body's end of the record and the header's are the record's, told twice.
        assert found.headers["idempotency-key-expires"] == http_date(
            datetime.fromisoformat(state["expires_at"]).timestamp()
        )
        replay = await client.get(
            "/idempotency-keys/k-1?replay=true", headers={"Authorization": "Bearer alice"}
        )
        assert replay.headers["idempotent-replayed"] == "true"
        assert (replay.status_code, replay.content) == (201, first.content)
    assert app.state.runs["orders"] == 1


async def test_another_caller_learns_what_a_key_never_seen_tells(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        first = await client.post(
            "/orders", json={}, headers={"Authorization": "Bearer alice", "Idempotency-Key": "k"}
        )
        assert first.status_code == 201
        bob = {"Authorization": "Bearer bob"}
        theirs = await client.get("/idempotency-keys/k", headers=bob)
        never = await client.get("/idempotency-keys/never-sent", headers=bob)
        anonymous = await client.get("/idempotency-keys/k")
        asked_for_replay = await client.get("/idempotency-keys/k?replay=true", headers=bob)
    assert theirs.json() == {"state": "unknown"}
    for answer in (theirs, anonymous, asked_for_replay):
        assert answer.status_code == never.status_code == 200
        assert answer.content == never.content
        assert sorted(answer.headers.items()) == sorted(never.headers.items())


async def test_a_lookup_sees_a_request_in_progress_and_its_lease(store: Store) -> None:
    app = service(store, lease=30)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/held", headers={"Idempotency-Key": "running"}))
        await app.state.gate.entered.wait()
        found = (await client.get("/idempotency-keys/running")).json()
        app.state.gate.opened.set()
    assert found["state"] == "in-progress"
    lease_until = datetime.fromisoformat(found["lease_until"]).timestamp()
    assert time.time() + 20 < lease_until < time.time() + 31


async def test_a_bad_key_in_the_path_is_a_400_problem(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        for path in ("/idempotency-keys/", "/idempotency-keys/a%20b"):
            answer = await client.get(path)
            assert answer.status_code == 400
            assert answer.json()["type"] == "urn:idempotency-mw:problem:invalid-key"


async def test_a_retry_first_sent_before_the_retention_and_the_purge_runs_nothing(
    store: Store,
) -> None:
    app = service(store)
    first_sent = time.time()
    headers = {"Idempotency-Key": "late", "Repeatability-First-Sent": http_date(first_sent)}
    async with client_for(app) as client:
        first = await client.post("/orders", json={"n": 1}, headers=headers)
        assert first.status_code == 201
        await anyio.sleep(RETENTION + 0.2)
        await store.purge_expired(batch_size=100)
        late = await client.post("/orders", json={"n": 1}, headers=headers)
        assert late.status_code == 412
        assert late.headers["content-type"] == "application/problem+json"
        assert late.json()["type"] == EXPIRED_KEY
        assert "idempotency-key-expires" not in late.headers
        # The refusal left no record behind, and ran nothing.
        assert (await client.get("/idempotency-keys/late")).json() == {"state": "unknown"}
        assert app.state.runs["orders"] == 1
        fresh = await client.post(
            "/orders",
            json={"n": 2},
            headers={"Idempotency-Key": "new", "Repeatability-First-Sent": http_date(time.time())},
        )
        assert fresh.status_code == 201
    assert app.state.runs["orders"] == 2


async def test_a_worker_behind_the_stores_clock_refuses_a_retry_stale_on_the_store() -> None:
    """The store's clock runs 25 s ahead of the worker's: a retry first sent 1 s ago on the
    worker's clock is 26 s old on the store's, which decides: past the retention, so 412."""
    store = MemoryStore(clock=lambda: time.time() + 25)
    app = service(store)
    sent = {"Idempotency-Key": "k", "Repeatability-First-Sent": http_date(time.time() - 1)}
    async with client_for(app) as client:
        late = await client.post("/orders", json={}, headers=sent)
        kept = await client.get("/idempotency-keys/k")
    assert late.status_code == 412
    assert late.json()["type"] == EXPIRED_KEY
    assert kept.json() == {"state": "unknown"}
    assert app.state.runs["orders"] == 0


async def test_an_old_first_sent_time_is_no_refusal_while_the_record_lives(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        first = await client.post("/orders", json={}, headers={"Idempotency-Key": "k"})
        old = http_date(time.time() - 3600)
        again = await client.post(
            "/orders", json={}, headers={"Idempotency-Key": "k", "Repeatability-First-Sent": old}
        )
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


async def test_a_first_sent_time_ahead_of_the_clock_is_refused(store: Store) -> None:
    app = service(store)
    ahead = http_date(time.time() + FIRST_SENT_SKEW + 60)
    async with client_for(app) as client:
        answer = await client.post(
            "/orders", json={}, headers={"Idempotency-Key": "k", "Repeatability-First-Sent": ahead}
        )
    assert answer.status_code == 412
    assert app.state.runs["orders"] == 0


#: Not HTTP-dates: prose, a day out of range, and numbers past what a date can hold.
UNPARSABLE_FIRST_SENT = (
    "yesterday",
    "Sun, 99 Nov 1994 08:49:37 GMT",
    "Sun, 06 Nov 1994 08:49:37 +99999999999999999999",
    "Sun, 06 Nov 99999999999 08:49:37 GMT",
    "Sun, 06 Nov 1994 99999999999:49:37 GMT",
)


async def test_an_unparsable_first_sent_time_is_a_400_problem(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        for value in (*UNPARSABLE_FIRST_SENT, ""):
            answer = await client.post(
                "/orders",
                json={},
                headers={"Idempotency-Key": "k", "Repeatability-First-Sent": value},
            )
            assert answer.status_code == 400, value
            assert answer.json()["type"] == "urn:idempotency-mw:problem:invalid-first-sent"
    assert app.state.runs["orders"] == 0


async def test_an_oasis_caller_keys_with_its_request_id_and_is_told_the_result(
    store: Store,
) -> None:
    app = service(store)
    async with client_for(app) as client:
        oasis = {
            "Repeatability-Request-ID": "3e0c1a52-7c1f-4b4f-9f5e-2f0d3c9d8a11",
            "Repeatability-First-Sent": http_date(time.time()),
        }
        first = await client.post("/orders", json={}, headers=oasis)
        again = await client.post("/orders", json={}, headers=oasis)
        both = await client.post(
            "/orders", json={}, headers={**oasis, "Idempotency-Key": "another"}
        )
        stale = await client.post(
            "/orders",
            json={},
            headers={
                "Repeatability-Request-ID": "never-seen",
                "Repeatability-First-Sent": http_date(time.time() - 3600),
            },
        )
    assert first.headers["repeatability-result"] == "accepted"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["repeatability-result"] == "accepted"
    assert both.status_code == 400
    assert stale.status_code == 412
    assert stale.headers["repeatability-result"] == "rejected"
    assert app.state.runs["orders"] == 1


async def test_every_keyed_answer_says_until_when_its_key_is_kept(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        before = time.time()
        first = await client.post("/orders", json={}, headers={"Idempotency-Key": "k"})
        replay = await client.post("/orders", json={}, headers={"Idempotency-Key": "k"})
        other = await client.post("/orders", json={"x": 1}, headers={"Idempotency-Key": "k"})
        unkeyed = await client.post("/orders", json={})
        schema = (await client.get("/openapi.json")).json()
    assert other.status_code == 409
    # An HTTP-date has whole seconds; the store's clock is another machine's.
    assert before + RETENTION - 2 <= expires(first) <= time.time() + RETENTION
    assert expires(replay) == expires(other)
    assert expires(first) - 1 <= expires(replay) <= expires(first) + 1
    assert "idempotency-key-expires" not in unkeyed.headers
    operation = schema["paths"]["/orders"]["post"]
    assert operation["x-idempotency"] == {"retention_seconds": RETENTION}
    assert "Idempotency-Key-Expires" in operation["responses"]["201"]["headers"]
    assert "412" in operation["responses"]
    assert "get" in schema["paths"]["/idempotency-keys/{key}"]


async def test_a_key_in_progress_past_its_ttl_is_said_to_be_kept_beyond_now(store: Store) -> None:
    """A record in progress outlives its TTL while its lease holds, and is kept ``ttl`` from
    its completion: a 409 never says a date already past."""
    # The lease is renewed every third of it: a loaded machine's late renewal still holds.
    app = service(store, lease=1.5, ttl=2)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/held", headers={"Idempotency-Key": "long"}))
        await app.state.gate.entered.wait()
        await anyio.sleep(2.2)  # past the ttl, the lease held
        busy = await client.post("/held", headers={"Idempotency-Key": "long"})
        app.state.gate.opened.set()
    assert busy.status_code == 409
    assert expires(busy) >= time.time()
