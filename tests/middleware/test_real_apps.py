"""Apps as users write them (FastAPI routers, mounts and dependencies, Litestar, a bare ASGI
callable) under real uvicorn servers of 1 and 2 workers sharing one SQLite store.

A key is sent 3 times; the handlers' runs are counted in a file of their own
(:class:`~tests.support.reliability_app.Effects`) and the store's records read from its table.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select

from idempotency_mw.stores.sql.schema import records
from idempotency_mw.values.metrics import key_hash
from tests.conftest import POSTGRESQL_URL, fresh_sql_store
from tests.support.faults import ServerProcess, free_port, upstream_port
from tests.support.real_apps import fenced_rows
from tests.support.reliability_app import Effects

SENDS = 3


class Served:
    """One factory of :mod:`tests.support.real_apps` under uvicorn, with its effects and store."""

    def __init__(self, server: ServerProcess, effects: Effects, store_url: str) -> None:
        self.server = server
        self.effects = effects
        self.store_url = store_url

    def post(self, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {**kwargs.pop("headers", {}), **({"Idempotency-Key": key} if key else {})}
        # A connection per request, so that a 2-worker server spreads them.
        with httpx.Client(base_url=self.server.url, timeout=30) as client:
            return client.post(path, headers=headers, **kwargs)

    def send_times(self, path: str, key: str, **kwargs: Any) -> list[httpx.Response]:
        return [self.post(path, key, **kwargs) for _ in range(SENDS)]

    def records_of(self, key: str) -> list[Any]:
        """The store's records of ``key``, read from its table (scope, status, response)."""
        engine = create_engine(self.store_url)
        try:
            with engine.connect() as connection:
                return list(
                    connection.execute(
                        select(records.c.scope, records.c.status, records.c.response_status).where(
                            records.c.key == key
                        )
                    )
                )
        finally:
            engine.dispose()


def _served(
    factory: str, workers: int, folder: Path, **env: str
) -> tuple[ServerProcess, Effects, str]:
    store_url = f"sqlite:///{folder / 'store.db'}"
    asyncio.run(_empty_store(store_url))
    effects = Effects(folder / "effects.db")
    server = ServerProcess(
        f"tests.support.real_apps:{factory}",
        {"REAL_APPS_STORE": store_url, "REAL_APPS_EFFECTS": effects.path, **env},
        workers=workers,
    )
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server, effects, store_url


async def _empty_store(url: str) -> None:
    await (await fresh_sql_store(url)).aclose()


def _serve(factory: str, **env: str) -> Any:
    """A module fixture: ``factory`` served by 1 and by 2 workers."""

    @pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
    def fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
        folder = tmp_path_factory.mktemp(factory)
        server, effects, store_url = _served(factory, request.param, folder, **env)
        try:
            yield Served(server, effects, store_url)
        finally:
            server.stop()

    return fixture


refusals = _serve("fastapi_refusals")
scoped = _serve("fastapi_scoped")


def new_key() -> str:
    return f"k-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- item 1: the endpoint began


@pytest.mark.parametrize(
    ("path", "route", "status", "body"),
    [
        ("/api/v1/rows", "rows", 403, {"detail": "limit exceeded"}),
        ("/api/v1/charges", "charges", 422, {"error": "card declined"}),
        ("/api/v1/sync-rows", "sync-rows", 403, {"detail": "limit exceeded"}),
        ("/sub/rows", "sub-rows", 403, {"detail": "limit exceeded"}),
    ],
    ids=["403-after-a-row", "422-after-a-charge", "sync-endpoint", "mounted-sub-app"],
)
def test_a_refusal_after_the_endpoint_acted_is_recorded_and_replayed(
    refusals: Served, path: str, route: str, status: int, body: dict[str, str]
) -> None:
    key = new_key()
    answers = refusals.send_times(path, key, json={"card": "4000000000000002"})
    assert [a.status_code for a in answers] == [status] * SENDS
    assert all(a.json() == body for a in answers)
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert refusals.effects.count(key) == 1
    assert [(r.status, r.response_status) for r in refusals.records_of(key)] == [
        ("completed", status)
    ]


def test_a_request_validation_error_touches_no_record_and_the_fixed_retry_runs(
    refusals: Served,
) -> None:
    key = new_key()
    invalid = refusals.post("/api/v1/orders", key, json={"amount": "many"})
    assert invalid.status_code == 422
    assert invalid.json()["detail"][0]["loc"] == ["body", "amount"]  # FastAPI's own answer
    assert refusals.records_of(key) == []
    fixed = refusals.send_times("/api/v1/orders", key, json={"amount": 3})
    assert [a.status_code for a in fixed] == [201] * SENDS
    assert [a.headers.get("idempotent-replayed") for a in fixed] == [None, "true", "true"]
    assert refusals.effects.count(key) == 1


def test_a_dependencys_401_touches_no_record_and_the_retry_with_a_token_runs(
    refusals: Served,
) -> None:
    key = new_key()
    refused = refusals.post("/api/v1/authed", key, headers={"Authorization": "Bearer stolen"})
    assert refused.status_code == 401
    assert refused.json() == {"detail": "bad token"}
    assert refused.headers["www-authenticate"] == "Bearer"
    assert refusals.records_of(key) == []
    assert refusals.effects.count(key) == 0
    good = {"Authorization": "Bearer alice-token"}
    answers = refusals.send_times("/api/v1/authed", key, headers=good)
    assert [a.status_code for a in answers] == [201] * SENDS
    assert answers[-1].json() == {"user": "alice"}
    assert refusals.effects.count(key) == 1


def test_release_statuses_of_a_route_still_release(refusals: Served) -> None:
    key = new_key()
    answers = refusals.send_times("/api/v1/released", key)
    assert [a.status_code for a in answers] == [403] * SENDS
    assert all(a.headers.get("idempotent-replayed") is None for a in answers)
    assert refusals.effects.count(key) == SENDS
    assert refusals.records_of(key) == []


def _alice(token: str = "alice-token") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_scope_comes_from_the_apps_dependency(scoped: Served) -> None:
    key = new_key()
    alice = scoped.send_times("/notes", key, headers=_alice())
    bob = scoped.send_times("/notes", key, headers=_alice("bob-token"))
    assert [a.status_code for a in alice + bob] == [201] * (2 * SENDS)
    # Two users' same key: two records, each replayed to its own user.
    assert len({a.json()["run"] for a in alice}) == 1
    assert len({a.json()["run"] for a in bob}) == 1
    assert alice[0].json() != bob[0].json()
    assert scoped.effects.count(key) == 2
    assert sorted((r.scope, r.status) for r in scoped.records_of(key)) == [
        ("alice", "completed"),
        ("bob", "completed"),
    ]


def test_a_bad_token_gets_the_apps_own_401_keyed_or_not(scoped: Served) -> None:
    key = new_key()
    keyed = scoped.post("/notes", key, headers=_alice("stolen"))
    unkeyed = scoped.post("/notes", headers=_alice("stolen"))
    elsewhere = scoped.post("/whoami", headers=_alice("stolen"))
    for answer in (keyed, unkeyed, elsewhere):
        assert answer.status_code == 401
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == {"detail": "bad token"}
        assert answer.headers["www-authenticate"] == "Bearer"
    assert scoped.records_of(key) == []
    assert scoped.effects.count(key) == 0


# ---------------------------------------------------------------- item 3: any ASGI app


@pytest.fixture(
    scope="module",
    params=[
        ("litestar_wrapped", 1),
        ("litestar_wrapped", 2),
        ("litestar_defined", 1),
        ("bare_asgi", 1),
        ("bare_asgi", 2),
    ],
    ids=lambda p: f"{p[0]}-{p[1]}w",
)
def other_app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    factory, workers = request.param
    folder = tmp_path_factory.mktemp(factory)
    server, effects, store_url = _served(factory, workers, folder)
    try:
        yield Served(server, effects, store_url)
    finally:
        server.stop()


def test_an_app_whose_routes_cannot_be_read_is_guarded(other_app: Served) -> None:
    missing = other_app.post("/orders", json={"amount": 1})
    assert missing.status_code == 400
    assert missing.headers["content-type"] == "application/problem+json"
    assert other_app.effects.count("") == 0

    key = new_key()
    answers = other_app.send_times("/orders", key, json={"amount": 1})
    assert [a.status_code for a in answers] == [201] * SENDS
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert len({a.content for a in answers}) == 1
    assert other_app.effects.count(key) == 1
    assert [r.status for r in other_app.records_of(key)] == ["completed"]

    mismatch = other_app.post("/orders", key, json={"amount": 2})
    assert mismatch.status_code == 409
    assert mismatch.json()["type"].endswith(":mismatch")
    assert other_app.effects.count(key) == 1


def test_routes_globs_apply_to_the_paths_of_an_app_whose_routes_cannot_be_read(
    other_app: Served,
) -> None:
    # /public/* makes the key optional; /orders (above) requires it.
    assert other_app.post("/public/ping").status_code == 201
    key = new_key()
    assert other_app.post("/public/ping", key).status_code == 201
    assert other_app.post("/public/ping", key).headers.get("idempotent-replayed") == "true"


@pytest.mark.parametrize(
    "other_app",
    [("litestar_wrapped", 1), ("litestar_defined", 1)],
    indirect=True,
    ids=["litestar_wrapped-1w", "litestar_defined-1w"],
)
def test_a_litestar_validation_error_releases_the_key(other_app: Served) -> None:
    # Litestar answers 400 before its handler runs, as FastAPI answers 422: nothing happened,
    # so nothing is recorded, and the corrected request runs under the same key.
    key = new_key()
    refused = other_app.post("/typed-orders", key, json={"amount": "one"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["detail"].startswith("Validation failed for POST /typed-orders")
    assert other_app.records_of(key) == []
    answers = other_app.send_times("/typed-orders", key, json={"amount": 1})
    assert [a.status_code for a in answers] == [201] * SENDS, answers[0].text
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert other_app.effects.count(key) == 1


# ---------------------------------------------------------------- item 4: fail-open and fence()


@pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
def fail_open(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("fail-open")
    rows_url = f"sqlite:///{folder / 'rows.db'}"
    engine = create_engine(rows_url)
    fenced_rows.metadata.create_all(engine)
    engine.dispose()
    # A PostgreSQL URL on a port nobody listens on: every claim fails to connect.
    dead = POSTGRESQL_URL.replace(f":{upstream_port(POSTGRESQL_URL, 5432)}/", f":{free_port()}/", 1)
    server, effects, _ = _served(
        "fastapi_fail_open",
        request.param,
        folder,
        REAL_APPS_EFFECTS_URL=rows_url.replace("sqlite:", "sqlite+aiosqlite:", 1),
        REAL_APPS_DEAD_STORE=dead,
    )
    try:
        yield Served(server, effects, rows_url)  # its "store": the effect's own database
    finally:
        server.stop()


def test_a_fenced_route_runs_unprotected_when_the_store_is_down(fail_open: Served) -> None:
    key = new_key()
    answer = fail_open.post("/fenced", key)
    assert answer.status_code == 201, answer.text
    assert answer.json() == {"ran": "unprotected"}
    assert fail_open.effects.count(key) == 1
    engine = create_engine(fail_open.store_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(select(fenced_rows).where(fenced_rows.c.idem_key == key))
            assert len(list(rows)) == 1  # the effect's transaction committed
    finally:
        engine.dispose()
    said = [line for line in fail_open.server.output().splitlines() if "unprotected" in line]
    assert len(said) == 1, said
    assert key_hash("", key) in said[0]
    assert "runs unprotected" in said[0]
    assert "fence() does nothing" in said[0]
