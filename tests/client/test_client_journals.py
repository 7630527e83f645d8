"""The journal contract, run on every journal: SQLite file, SQL (SQLite, PostgreSQL, MariaDB)
and Redis; then a client that restarts over each resumes and settles its operation.

Servers are shared: each test writes only operation names (SQL) or keys (Redis) under a prefix
of its own, looks only at those, and deletes them afterwards.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis
from sqlalchemy import create_engine, delete, select
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import ConfigurationError, IdempotencyMiddleware, SchemaError, SQLStore
from idempotency_mw.client import (
    CredentialsMissing,
    IdempotentClient,
    Journal,
    JournalEntry,
    OperationState,
    OutcomeUnknown,
    RedisJournal,
    RetryPolicy,
    SQLiteJournal,
    SQLJournal,
    journal_table,
    sync_url,
)
from idempotency_mw.client import open_journal as journal_at
from idempotency_mw.client.journals import needing_attention
from idempotency_mw.client.protocol import key_digest
from idempotency_mw.operator.cli import main as cli
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import metadata
from tests.conftest import (
    MARIADB_URL,
    POSTGRESQL_URL,
    REDIS_URL,
    fresh_journal_table,
    require_server,
)
from tests.support.client_support import sqlite_store_at

JOURNALS = ["sqlite-file", "sql-sqlite", "sql-postgresql", "sql-mariadb", "redis"]
SQL_SERVERS = {"sql-postgresql": POSTGRESQL_URL, "sql-mariadb": MARIADB_URL}

OpenJournal = Callable[[], Journal]


@pytest.fixture
def prefix() -> str:
    """This test's own prefix for operation names and Redis keys."""
    return f"t{uuid.uuid4().hex[:12]}-"


@pytest.fixture(params=JOURNALS)
def open_journal(
    request: pytest.FixtureRequest, tmp_path: Path, prefix: str
) -> Iterator[OpenJournal]:
    """Opens journals over one storage: each call is a new process's view of it."""
    kind: str = request.param
    opened: list[Journal] = []
    make: OpenJournal
    if kind == "sqlite-file":

        def make() -> Journal:
            return SQLiteJournal(tmp_path / "journal.sqlite3")

    elif kind == "redis":
        require_server(REDIS_URL)

        def make() -> Journal:
            return RedisJournal(REDIS_URL, prefix=f"test-{prefix}")

    else:
        url = SQL_SERVERS.get(kind, f"sqlite:///{tmp_path / 'journal.db'}")
        if kind in SQL_SERVERS:
            require_server(url)
            fresh_journal_table(url)

        def make() -> Journal:
            return SQLJournal(url)

    def tracked() -> Journal:
        journal = make()
        opened.append(journal)
        return journal

    yield tracked
    for journal in opened:
        journal.close()
    if kind == "redis":
        with redis.Redis.from_url(REDIS_URL) as client:
            keys = list(client.scan_iter(match=f"test-{prefix}*"))
            if keys:
                client.delete(*keys)
    elif kind in SQL_SERVERS:
        engine = create_engine(sync_url(SQL_SERVERS[kind]))
        with engine.begin() as conn:
            conn.execute(delete(journal_table).where(journal_table.c.name.startswith(prefix)))
        engine.dispose()


@pytest.fixture
def journal(open_journal: OpenJournal) -> Journal:
    return open_journal()


def mine(entries: list[JournalEntry], prefix: str) -> list[JournalEntry]:
    """The entries of this test (a shared server holds other tests' too)."""
    return [entry for entry in entries if entry.name.startswith(prefix)]


def pending(prefix: str, n: int, ref: str | None = None, name: str = "op") -> JournalEntry:
    return JournalEntry(f"{prefix}key-{n}", f"{prefix}{name}", ref, OperationState.PENDING)


def sent(entry: JournalEntry, state: OperationState = OperationState.SENT) -> JournalEntry:
    """``entry`` with a request, binary body and repeated headers, in ``state``; settled, with
    a binary response too."""
    return JournalEntry(
        entry.key,
        entry.name,
        entry.ref,
        state,
        method="POST",
        url="http://testserver/tickets?q=1",
        headers=(("x-trace", "1"), ("x-tag", "a"), ("x-tag", "b")),
        body=bytes(range(256)),
        status=None if state is OperationState.SENT else 503,
        keyless=state is OperationState.UNKNOWN,
        first_sent_at=1_800_000_000.123456,  # 2027-01-15 08:00:00 UTC
        response_headers=(("x-tag", "c"), ("x-tag", "d")) if state.settled else (),
        response_body=bytes(range(255, -1, -1)) if state.settled else None,
    )


# --- The contract ---------------------------------------------------------------------------


def test_add_stores_a_pending_entry_and_get_returns_it(journal: Journal, prefix: str) -> None:
    entry = pending(prefix, 1, ref="order-17")
    assert journal.add(entry) == entry
    assert journal.get(entry.key) == entry
    assert journal.get(f"{prefix}missing") is None
    assert isinstance(journal, Journal)


def test_add_with_the_same_name_and_ref_returns_the_first_entry_unchanged(
    journal: Journal, prefix: str
) -> None:
    first = journal.add(pending(prefix, 1, ref="order-17"))
    journal.save(sent(first, OperationState.UNKNOWN))
    again = journal.add(pending(prefix, 2, ref="order-17"))
    other_name = journal.add(pending(prefix, 3, ref="order-17", name="other"))
    other_ref = journal.add(pending(prefix, 4, ref="order-18"))
    assert again == sent(first, OperationState.UNKNOWN)
    assert journal.get(f"{prefix}key-2") is None
    assert (other_name.key, other_ref.key) == (f"{prefix}key-3", f"{prefix}key-4")


def test_entries_without_ref_are_never_merged_and_a_known_key_is_kept(
    journal: Journal, prefix: str
) -> None:
    one, two = journal.add(pending(prefix, 1)), journal.add(pending(prefix, 2))
    journal.save(sent(one))
    assert one.key != two.key
    assert journal.add(pending(prefix, 1)) == sent(one)


def test_save_replaces_the_request_and_state_but_not_name_or_ref(
    journal: Journal, prefix: str
) -> None:
    entry = journal.add(pending(prefix, 1, ref="r"))
    states = []
    for state in (OperationState.SENT, OperationState.UNKNOWN, OperationState.CONFIRMED):
        journal.save(sent(entry, state))
        stored = journal.get(entry.key)
        assert stored == sent(entry, state)
        states.append(stored.state)
    assert states == ["sent", "unknown", "confirmed"]
    journal.save(JournalEntry(entry.key, f"{prefix}renamed", "other", OperationState.FAILED))
    assert journal.get(entry.key) == JournalEntry(entry.key, entry.name, "r", OperationState.FAILED)


def test_save_inserts_an_entry_it_does_not_have(journal: Journal, prefix: str) -> None:
    entry = sent(pending(prefix, 1, ref="r"))
    journal.save(entry)
    assert journal.get(entry.key) == entry
    assert journal.add(pending(prefix, 2, ref="r")) == entry


def test_unsettled_lists_pending_sent_and_unknown_oldest_first(
    journal: Journal, prefix: str
) -> None:
    entries = [journal.add(pending(prefix, n)) for n in range(1, 6)]
    journal.save(sent(entries[0], OperationState.UNKNOWN))  # saving keeps its place
    journal.save(sent(entries[1], OperationState.CONFIRMED))
    journal.save(sent(entries[2], OperationState.FAILED))
    journal.save(sent(entries[3]))
    later = sent(pending(prefix, 6))
    journal.save(later)
    assert mine(journal.unsettled(), prefix) == [
        sent(entries[0], OperationState.UNKNOWN),
        sent(entries[3]),
        entries[4],
        later,
    ]
    journal.save(sent(entries[0], OperationState.CONFIRMED))
    assert [e.key for e in mine(journal.unsettled(), prefix)] == [
        entries[3].key,
        entries[4].key,
        later.key,
    ]


def test_unsettled_includes_what_needs_attention(journal: Journal, prefix: str) -> None:
    needs = [OperationState.NEEDS_CONFIRMATION, OperationState.NEEDS_INTERVENTION]
    entries = [journal.add(pending(prefix, n)) for n in range(2)]
    for entry, state in zip(entries, needs, strict=True):
        journal.save(sent(entry, state))
    assert [(e.key, e.state) for e in mine(journal.unsettled(), prefix)] == [
        (entries[0].key, OperationState.NEEDS_CONFIRMATION),
        (entries[1].key, OperationState.NEEDS_INTERVENTION),
    ]
    assert [e.key for e in mine(needing_attention(journal), prefix)] == [e.key for e in entries]


def test_a_lease_has_one_holder_until_released_or_lapsed(
    open_journal: OpenJournal, prefix: str
) -> None:
    one, two = open_journal(), open_journal()
    entry = one.add(pending(prefix, 1, ref="r"))
    assert one.acquire(entry.key, "holder-1", 30.0)
    assert one.acquire(entry.key, "holder-1", 30.0)  # renewing, or a statement run twice
    assert not two.acquire(entry.key, "holder-2", 30.0)
    two.release(entry.key, "holder-2")  # not the holder: changes nothing
    assert not two.acquire(entry.key, "holder-2", 30.0)
    one.release(entry.key, "holder-1")
    # A lease long enough that the next statement comes within it on a busy machine too.
    assert two.acquire(entry.key, "holder-2", 1.0)
    assert not one.acquire(entry.key, "holder-1", 30.0)
    time.sleep(1.2)  # holder-2 died: its lease lapses
    assert one.acquire(entry.key, "holder-1", 30.0)
    assert not two.acquire(entry.key, "holder-2", 30.0)
    assert not one.acquire(f"{prefix}missing", "holder-1", 30.0)
    one.save(sent(entry, OperationState.CONFIRMED))  # saving leaves the lease alone
    assert not two.acquire(entry.key, "holder-2", 30.0)
    assert two.get(entry.key) == sent(entry, OperationState.CONFIRMED)


def test_entries_outlive_the_journal(open_journal: OpenJournal, prefix: str) -> None:
    before = open_journal()
    entry = before.add(pending(prefix, 1, ref="r"))
    before.save(sent(entry, OperationState.UNKNOWN))
    before.close()
    after = open_journal()
    assert after.get(entry.key) == sent(entry, OperationState.UNKNOWN)
    assert after.add(pending(prefix, 2, ref="r")).key == entry.key
    assert mine(after.unsettled(), prefix) == [sent(entry, OperationState.UNKNOWN)]


def test_concurrent_adds_of_one_name_and_ref_agree_on_one_key(
    open_journal: OpenJournal, prefix: str
) -> None:
    journals = [open_journal(), open_journal()]
    with ThreadPoolExecutor(8) as pool:
        keys = set(
            pool.map(
                lambda n: journals[n % 2].add(pending(prefix, n, ref="r")).key,
                range(32),
            )
        )
    assert len(keys) == 1
    assert [e.key for e in mine(journals[0].unsettled(), prefix)] == list(keys)


# --- Restart against the real middleware ----------------------------------------------------


class Scoped:
    """A journal that shows reconcile() only this test's unsettled entries."""

    def __init__(self, inner: Journal, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix
        self.add = inner.add
        self.save = inner.save
        self.get = inner.get
        self.acquire = inner.acquire
        self.release = inner.release
        self.close = inner.close

    def unsettled(self) -> list[JournalEntry]:
        return mine(self.inner.unsettled(), self.prefix)


class Lossy(httpx.AsyncBaseTransport):
    """The app runs every request; with ``lose``, its response is lost to a read timeout."""

    def __init__(self, app: Starlette, *, lose: bool) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.lose = lose
        self.keys: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers["idempotency-key"])
        response = await self.inner.handle_async_request(request)
        await response.aread()
        if self.lose:
            raise httpx.ReadTimeout("read timed out", request=request)
        return response


async def no_sleep(seconds: float) -> None:
    pass


@pytest.mark.anyio
async def test_restarted_client_resumes_the_key_and_reconcile_settles_it(
    open_journal: OpenJournal, prefix: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'idem.db'}"
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    await engine.dispose()
    store = SQLStore(url)
    calls: Counter[str] = Counter()

    async def tickets(request: Request) -> Response:
        calls["tickets"] += 1
        return JSONResponse({"id": calls["tickets"], **await request.json()}, 201)

    app = Starlette(
        routes=[Route("/tickets", tickets, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )

    def client(transport: Lossy, policy: RetryPolicy) -> IdempotentClient:
        return IdempotentClient(
            http=httpx.AsyncClient(transport=transport, base_url="http://testserver"),
            journal=Scoped(open_journal(), prefix),
            policy=policy,
            sleep=no_sleep,
        )

    name = f"{prefix}create-ticket"
    lossy = Lossy(app, lose=True)
    before = client(lossy, RetryPolicy(max_attempts=2, backoff_base=0.0))
    try:
        async with before._http:
            op = await before.operation(name, ref="order-17")
            with pytest.raises(OutcomeUnknown):
                await before.send(op, "POST", "/tickets", json={"title": "t"})
    finally:
        await before.aclose()

    healthy = Lossy(app, lose=False)
    after = client(healthy, RetryPolicy(backoff_base=0.0))  # a new process, the same journal
    try:
        async with after._http:
            resumed = await after.operation(name, ref="order-17")
            other = await after.operation(name, ref="order-18")
            unknown = after.journal.get(op.key)
            settled = await after.reconcile()
            again = await after.reconcile()
    finally:
        await after.aclose()
        await store.aclose()
    assert resumed == op
    assert other.key != op.key
    assert unknown is not None
    assert unknown.state is OperationState.UNKNOWN
    assert [(e.key, e.state, e.status) for e in settled] == [
        (op.key, OperationState.CONFIRMED, 201)
    ]
    assert again == []
    assert calls["tickets"] == 1
    assert set(lossy.keys + healthy.keys) == {op.key}


TOKEN = "Bearer s3cret-token-4f1d"
API_KEY = "k3y-5ecret-9a7e"


def stored_bytes(journal: Journal, prefix: str, tmp_path: Path) -> bytes:
    """Everything the journal holds on its storage, as raw as it is kept: the SQLite files
    (with their write-ahead logs), this test's rows on a server, its Redis keys dumped."""
    if isinstance(journal, RedisJournal):
        with redis.Redis.from_url(REDIS_URL) as client:
            return b"".join(
                cast(bytes, client.dump(key)) for key in client.scan_iter(f"test-{prefix}*")
            )
    assert isinstance(journal, SQLJournal)
    if journal.engine.dialect.name == "sqlite":
        return b"".join(path.read_bytes() for path in tmp_path.iterdir() if path.is_file())
    with journal.engine.connect() as conn:
        rows = conn.execute(
            select(journal_table).where(journal_table.c.name.startswith(prefix))
        ).all()
    return repr(rows).encode()


@pytest.mark.anyio
async def test_no_credential_is_journaled_and_a_restart_resends_with_the_clients_own(
    open_journal: OpenJournal, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = await sqlite_store_at(tmp_path / "idem.db")
    runs: list[str] = []

    async def tickets(request: Request) -> Response:
        runs.append(request.headers["authorization"])
        return JSONResponse({"id": len(runs)}, 201)

    # The middleware binds the record to Authorization and X-API-Key: a resend without them,
    # or with others, would be refused 409 credential-mismatch, never replayed.
    app = Starlette(
        routes=[Route("/tickets", tickets, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
    )
    inner = open_journal()
    name = f"{prefix}create-ticket"
    credentials = {"Authorization": TOKEN, "X-API-Key": API_KEY}
    lossy = Lossy(app, lose=True)
    before = IdempotentClient(
        http=httpx.AsyncClient(transport=lossy, base_url="http://testserver"),
        journal=Scoped(inner, prefix),
        policy=RetryPolicy(max_attempts=2, backoff_base=0.0),
        sleep=no_sleep,
    )
    async with before._http:
        op = await before.operation(name)
        with pytest.raises(OutcomeUnknown):
            await before.send(
                op, "POST", "/tickets", json={"title": "t"}, headers={**credentials, "X-Tag": "a"}
            )
        entry = before.journal.get(op.key)
    assert runs == [TOKEN]  # the attempts of this process carried the call's credentials
    raw = stored_bytes(inner, prefix, tmp_path)
    assert b"X-Tag" in raw or b"x-tag" in raw  # the storage read back is the journal's
    for secret in ("s3cret-token-4f1d", API_KEY):
        assert secret.encode() not in raw
        assert secret not in repr(entry)
        assert secret not in caplog.text
    assert entry is not None
    assert entry.withheld == ("authorization", "x-api-key")

    # A new process without the credentials refuses to resend, naming them: nothing is sent.
    healthy = Lossy(app, lose=False)
    bare = IdempotentClient(
        http=httpx.AsyncClient(transport=healthy, base_url="http://testserver"),
        journal=Scoped(open_journal(), prefix),
        sleep=no_sleep,
    )
    async with bare._http:
        with pytest.raises(CredentialsMissing) as missing:
            await bare.send(op, "POST", "/tickets", json={"title": "t"})
        [kept] = await bare.reconcile()
    assert missing.value.headers == ("authorization", "x-api-key")
    assert "authorization, x-api-key" in str(missing.value)
    assert kept.state is OperationState.UNKNOWN
    assert healthy.keys == []

    # One configured with them resends with them, and is replayed the first run's answer.
    http = httpx.AsyncClient(transport=healthy, base_url="http://testserver", headers=credentials)
    after = IdempotentClient(http=http, journal=Scoped(open_journal(), prefix), sleep=no_sleep)
    try:
        async with http:
            [settled] = await after.reconcile()
    finally:
        await after.aclose()
        await store.aclose()
    assert (settled.state, settled.status) == (OperationState.CONFIRMED, 201)
    assert runs == [TOKEN]
    assert healthy.keys == [op.key]


# --- Construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql+psycopg2://u@h/db", "postgresql+psycopg2://u@h/db"),
        ("mysql://u@h/db", "mysql+pymysql://u@h/db"),
        ("mariadb+asyncmy://u@h/db", "mariadb+pymysql://u@h/db"),
        ("sqlite:///x.db", "sqlite:///x.db"),
        ("sqlite+aiosqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_sql_urls_get_sync_drivers(url: str, expected: str) -> None:
    assert sync_url(url).render_as_string(hide_password=False) == expected


@pytest.mark.parametrize("url", ["oracle://u@h/db", "not a url"])
def test_unsupported_sql_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigurationError):
        SQLJournal(url)


def test_open_journal_takes_a_path_a_database_url_or_a_redis_url(tmp_path: Path) -> None:
    journals = [
        journal_at(tmp_path / "j.sqlite3"),
        journal_at(f"sqlite:///{tmp_path / 'j.db'}"),
        journal_at(REDIS_URL),
    ]
    for journal in journals:
        journal.close()
    assert [type(j) for j in journals] == [SQLiteJournal, SQLJournal, RedisJournal]


def test_a_missing_database_driver_names_the_extra_to_install() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"install the \[client-mysql\] extra \(pip install 'idempotency-mw\[client-mysql\]', "
        r"or from a checkout: pip install -e '\.\[client-mysql\]'\)",
    ):
        SQLJournal("mysql+mysqldb://u@h/db")


def test_a_journal_table_of_an_older_version_is_a_schema_error(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE idempotency_client_journal (id INTEGER PRIMARY KEY, key TEXT)"
        )
    with SQLJournal(engine) as journal, pytest.raises(SchemaError, match="keyless"):
        journal.get("k")
    engine.dispose()


def test_sql_journal_leaves_a_given_engine_alone(tmp_path: Path, prefix: str) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'journal.db'}")
    pool = engine.pool
    with SQLJournal(engine) as journal:
        journal.add(pending(prefix, 1))
    assert engine.pool is pool  # dispose() would have replaced it
    assert SQLJournal(engine).get(f"{prefix}key-1") == pending(prefix, 1)
    engine.dispose()


def test_redis_journal_never_closes_a_given_client(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis.Redis()
    closed: list[bool] = []
    monkeypatch.setattr(client, "close", lambda: closed.append(True))
    RedisJournal(client=client, prefix=prefix).close()
    assert closed == []


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"url": REDIS_URL, "client": redis.Redis()},
        {"client": redis.Redis(decode_responses=True)},
    ],
)
def test_redis_journal_options_are_checked(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RedisJournal(**options)  # type: ignore[arg-type]


# --- The attention command ------------------------------------------------------------------


def test_journal_attention_lists_what_needs_a_person(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    require_server(POSTGRESQL_URL)
    fresh_journal_table(POSTGRESQL_URL)
    with SQLJournal(POSTGRESQL_URL) as journal:
        entry = journal.add(pending(prefix, 1, ref="order-17"))
        journal.save(sent(entry, OperationState.NEEDS_CONFIRMATION))
        settled = journal.add(pending(prefix, 2, ref="order-18"))
        journal.save(sent(settled, OperationState.CONFIRMED))
        try:
            assert cli(["journal", "attention", "--journal", POSTGRESQL_URL]) == 0
        finally:
            with journal.engine.begin() as conn:
                conn.execute(delete(journal_table).where(journal_table.c.name.startswith(prefix)))
    lines = capsys.readouterr().out.splitlines()
    mine = [line.split() for line in lines if prefix in line]
    first_sent = ["2027-01-15", "08:00:00"]
    digest = key_digest(entry.key)
    assert mine == [["needs_confirmation", f"{prefix}op", "order-17", "503", *first_sent, digest]]
    assert entry.key not in "\n".join(lines)  # keys are never printed, only their digests


def test_journal_attention_with_nothing_to_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "journal.sqlite3"
    with SQLiteJournal(path) as journal:
        assert journal.unsettled() == []
    assert cli(["journal", "attention", "--journal", str(path)]) == 0
    assert capsys.readouterr().out == "idempotency-mw: no operation needs attention\n"


@pytest.mark.parametrize(
    ("where", "status", "says"),
    [
        ("no/such/journal.sqlite3", 2, "no journal file at"),
        ("oracle://u@h/db", 2, "unsupported database"),
        ("postgresql://postgres@127.0.0.1:1/none", 1, "OperationalError"),
    ],
)
def test_journal_attention_errors_are_one_line(
    where: str, status: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["journal", "attention", "--journal", where]) == status
    err = capsys.readouterr().err
    assert says in err
    assert err.count("\n") == 1
