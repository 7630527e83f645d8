"""Hostile input: keys, duplicate headers, bodies, methods and paths, from hypothesis and
schemathesis.

Properties, for every input: the service never answers 500; a handler never runs twice for one
key and one request; every rejection is an RFC 9457 problem with the status the README names.

The hypothesis tests drive the ASGI app by hand (so that any header bytes, framing and method
reach it) on SQLite. Each runs one app for all its examples, in an event loop of its own
(a blocking portal), and gives each example a caller of its own, so that examples never share
a key. The schemathesis test runs the example service under uvicorn.
"""

from __future__ import annotations

import hashlib
import json
import string
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest
import schemathesis
from anyio.from_thread import BlockingPortal, start_blocking_portal
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from requests.structures import CaseInsensitiveDict
from schemathesis.core.result import Ok
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from example_app.app import create_app as create_example_app
from example_app.orders import MAILBOX_UNAVAILABLE, REFUND_NEEDS_APPROVAL
from idempotency_mw import IdempotencyMiddleware, SQLStore, idempotent
from idempotency_mw.stores.sql import async_url
from tests.conftest import POSTGRESQL_URL, fresh_sql_store, require_server
from tests.support.faults import ServerProcess

PROBLEM = "application/problem+json"
#: What the app answers before an endpoint begins: no such route, not this method, invalid.
REFUSED_BEFORE_THE_ENDPOINT = frozenset({404, 405, 422})
KEY = b"idempotency-key"
LIMIT = 2048  # max_request_bytes of the app under test
EXAMPLES = settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------- ASGI by hand


@dataclass
class Reply:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    raised: str = ""

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def replayed(self) -> bool:
        return self.header(b"idempotent-replayed") == b"true"

    def problem(self) -> str:
        """The problem type's slug, after checking that this is a well-formed problem."""
        assert self.header(b"content-type") == PROBLEM.encode(), self
        body: dict[str, Any] = json.loads(self.body)
        assert body["status"] == self.status
        assert body["title"]
        assert body["detail"]
        return str(body["type"]).removeprefix("urn:idempotency-mw:problem:")


async def call(
    app: Any,
    method: str = "POST",
    path: str = "/echo",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[bytes] | None = None,
    query: bytes = b"",
) -> Reply:
    """One request straight into ``app``: any header bytes, framing, method and path."""
    chunks = [b""] if chunks is None else chunks
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": quote(path, safe="/", errors="surrogateescape").encode(),
        "root_path": "",
        "query_string": query,
        "headers": [(b"host", b"testserver"), *(headers or [])],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 4321),
        "state": {},
    }
    messages = [
        {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        for index, chunk in enumerate(chunks)
    ]
    reply = Reply()
    answered = anyio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    except Exception as exc:  # the app's error middleware answers 500, then re-raises
        reply.raised = f"{type(exc).__name__}: {exc}"
    return reply


# ---------------------------------------------------------------- the app under test


def hostile_app(store: SQLStore) -> FastAPI:
    """Routes of every kind; ``app.state.runs`` counts handler runs per caller."""
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        scope=lambda connection: connection.headers.get("x-caller", "anonymous"),
        max_request_bytes=LIMIT,
    )
    runs: Counter[str] = Counter()
    app.state.runs = runs

    def ran(request: Request) -> int:
        caller = request.headers.get("x-caller", "")
        runs[caller] += 1
        return runs[caller]

    @app.post("/echo")
    @idempotent(required=True)
    async def echo(request: Request) -> dict[str, Any]:
        body = await request.body()
        return {"run": ran(request), "size": len(body), "sha": hashlib.sha256(body).hexdigest()}

    @app.put("/items/{item_id}")
    async def put_item(item_id: str, request: Request) -> dict[str, Any]:
        return {"run": ran(request), "item": item_id}

    @app.delete("/items/{item_id}")
    async def delete_item(item_id: int, request: Request) -> dict[str, Any]:
        return {"run": ran(request), "item": item_id}

    @app.get("/items")
    async def list_items(request: Request) -> dict[str, int]:
        return {"run": ran(request)}

    return app


class Harness:
    """One app on one SQLite store, in an event loop of its own, for all of a test's examples."""

    def __init__(self, portal: BlockingPortal, app: Any, store: SQLStore) -> None:
        self.portal = portal
        self.app = app
        self.store = store

    def call(self, *args: Any, **kwargs: Any) -> Reply:
        reply: Reply = self.portal.call(lambda: call(self.app, *args, **kwargs))
        assert reply.status != 500, reply
        assert not reply.raised, reply
        return reply

    def runs(self, caller: str) -> int:
        runs: Counter[str] = self.app.state.runs
        return runs[caller]


@contextmanager
def harness(tmp_path: Path) -> Iterator[Harness]:
    """The hostile app on a fresh SQLite store, in a blocking portal's event loop."""
    with start_blocking_portal() as portal:
        store = portal.call(fresh_sql_store, f"sqlite:///{tmp_path / 'hostile.db'}")
        try:
            yield Harness(portal, hostile_app(store), store)
        finally:
            portal.call(store.aclose)


@contextmanager
def running(app: Any) -> Iterator[BlockingPortal]:
    """A portal whose event loop runs ``app``'s lifespan (startup now, shutdown at the end)."""

    async def lifespan() -> LifespanManager:
        return LifespanManager(app)

    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(portal.call(lifespan)),
    ):
        yield portal


def new_caller() -> str:
    return uuid.uuid4().hex


def caller_header(caller: str) -> tuple[bytes, bytes]:
    return (b"x-caller", caller.encode())


# ---------------------------------------------------------------- keys


def expected_key(raw: bytes) -> str | None:
    """The key a header value stands for, by the README's rules (``None``: invalid).

    Bare: 1-255 visible ASCII characters. Quoted: a Structured-Field string (printable ASCII,
    ``\\"`` and ``\\\\`` the only escapes) whose content is 1-255 characters.
    """
    value = raw.decode("latin-1")
    if not value.startswith('"'):
        key = value
        if not all("!" <= char <= "~" for char in key):
            return None
    else:
        if len(value) < 2 or not value.endswith('"'):
            return None
        chars: list[str] = []
        inner = iter(value[1:-1])
        for char in inner:
            if not " " <= char <= "~" or char == '"':
                return None
            if char == "\\":
                char = next(inner, "")
                if char not in ('"', "\\") or not char:
                    return None
            chars.append(char)
        key = "".join(chars)
    return key if 1 <= len(key) <= 255 else None


def sf_quote(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
LATIN1 = st.characters(min_codepoint=0x00, max_codepoint=0xFF)
KEY_VALUES = st.one_of(
    st.text(VISIBLE, min_size=1, max_size=40),  # plain keys
    st.text(VISIBLE, min_size=250, max_size=260),  # around the length limit
    st.text(PRINTABLE, max_size=40).map(sf_quote),  # quoted, escapes included
    st.text(PRINTABLE, min_size=250, max_size=260).map(sf_quote),
    st.text(PRINTABLE, max_size=20).map(lambda t: '"' + t),  # unterminated, stray quotes...
    st.text(LATIN1, max_size=40),  # control characters, DEL, Latin-1
    st.sampled_from(["", " ", '"', '""', '"\\"', '"a\\b"', "a b", "\t", '"\x00"', "ok\x7f"]),
).map(lambda value: value.encode("latin-1"))
NON_ASCII_KEYS = st.text(min_size=1, max_size=30).map(lambda value: value.encode())


def test_any_key_header_runs_once_and_replays_or_is_a_400_problem(tmp_path: Path) -> None:
    with harness(tmp_path) as h:

        @EXAMPLES
        @given(raw=st.one_of(KEY_VALUES, NON_ASCII_KEYS))
        def check(raw: bytes) -> None:
            caller = new_caller()
            headers = [(KEY, raw), caller_header(caller)]
            replies = [h.call(headers=headers, chunks=[b'{"a": 1}']) for _ in range(3)]
            if expected_key(raw) is None:
                assert all(r.status == 400 and r.problem() == "invalid-key" for r in replies)
                assert h.runs(caller) == 0
            else:
                first, *again = replies
                assert first.status == 200, first
                assert not first.replayed
                assert all(r.replayed and r.body == first.body for r in again)
                assert h.runs(caller) == 1

        check()


def test_quoted_and_bare_forms_of_a_key_are_one_key(tmp_path: Path) -> None:
    with harness(tmp_path) as h:

        @EXAMPLES
        @given(key=st.text(VISIBLE, min_size=1, max_size=255).filter(lambda k: k[0] != '"'))
        def check(key: str) -> None:
            caller = caller_header(new_caller())
            bare = h.call(headers=[(KEY, key.encode()), caller])
            quoted = h.call(headers=[(KEY, sf_quote(key).encode()), caller])
            assert bare.status == 200
            assert quoted.replayed
            assert quoted.body == bare.body

        check()


def test_two_key_headers_are_a_400_problem_and_nothing_runs(tmp_path: Path) -> None:
    # (ASGI servers lower-case header names, so the two differ in value alone.)
    with harness(tmp_path) as h:

        @EXAMPLES
        @given(first=KEY_VALUES, second=KEY_VALUES, same=st.booleans())
        def check(first: bytes, second: bytes, same: bool) -> None:
            caller = new_caller()
            headers = [(KEY, first), caller_header(caller), (KEY, first if same else second)]
            for _ in range(2):
                reply = h.call(headers=headers, chunks=[b"{}"])
                assert reply.status == 400
                assert reply.problem() == "invalid-key"
            assert h.runs(caller) == 0

        check()


# ---------------------------------------------------------------- bodies


@st.composite
def framed_bodies(draw: st.DrawFn) -> tuple[bytes, list[bytes], bytes | None]:
    """A body, the chunks it is sent in, and its Content-Length header (or none: chunked)."""
    body = draw(
        st.one_of(
            st.binary(max_size=64),
            st.binary(min_size=LIMIT - 8, max_size=LIMIT + 8),
            st.sampled_from([b"", b"\x00" * 100, b"\xff\xfe\xfd", "é€😀".encode()]),
        )
    )
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    chunked = draw(st.booleans())
    return body, chunks, None if chunked else str(len(body)).encode()


def test_any_body_runs_once_and_replays_or_is_a_413_problem(tmp_path: Path) -> None:
    with harness(tmp_path) as h:

        @EXAMPLES
        @given(framed=framed_bodies())
        def check(framed: tuple[bytes, list[bytes], bytes | None]) -> None:
            body, chunks, length = framed
            caller = new_caller()
            headers = [(KEY, b"k"), caller_header(caller)]
            if length is not None:
                headers.append((b"content-length", length))
            first = h.call(headers=headers, chunks=chunks)
            again = h.call(headers=headers, chunks=chunks)
            if len(body) > LIMIT:
                assert first.status == again.status == 413
                assert first.problem() == again.problem() == "request-too-large"
                assert h.runs(caller) == 0
                # A 413 leaves nothing behind: the key still works.
                small = h.call(headers=[(KEY, b"k"), caller_header(caller)], chunks=[b"ok"])
                assert small.status == 200
                assert not small.replayed
            else:
                assert first.status == 200, first
                answer = json.loads(first.body)
                assert answer["size"] == len(body)
                assert answer["sha"] == hashlib.sha256(body).hexdigest()
                assert again.replayed
                assert again.body == first.body
                assert h.runs(caller) == 1

        check()


def test_hostile_content_length_is_never_a_500(tmp_path: Path) -> None:
    with harness(tmp_path) as h:
        # (Values that str.isdigit() accepts but int() does not: the test below.)
        @EXAMPLES
        @given(
            declared=st.one_of(
                st.from_regex(r"\A[0-9]{1,40}\Z"),
                st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12),
                st.sampled_from(["-1", "+5", " 2", "2 ", "0x10", "1e3", "", "3, 3"]),
            ),
            body=st.binary(max_size=32),
        )
        def check(declared: str, body: bytes) -> None:
            caller = new_caller()
            headers = [(KEY, b"k"), caller_header(caller), (b"content-length", declared.encode())]
            replies = [h.call(headers=headers, chunks=[body]) for _ in range(2)]
            if declared.isdigit() and int(declared) > LIMIT:
                assert all(r.status == 413 and r.problem() == "request-too-large" for r in replies)
            assert h.runs(caller) <= 1

        check()


@pytest.mark.parametrize("declared", ["\u00b2", "9" * 5000], ids=["superscript-two", "huge"])
def test_content_length_that_int_rejects_is_not_a_500(tmp_path: Path, declared: str) -> None:
    with harness(tmp_path) as h:
        headers = [(KEY, b"k"), caller_header(new_caller())]
        reply = h.portal.call(
            lambda: call(h.app, headers=[*headers, (b"content-length", declared.encode("latin-1"))])
        )
    assert reply.status != 500, reply
    assert not reply.raised


# ---------------------------------------------------------------- methods and paths

METHODS = st.one_of(
    st.sampled_from(["POST", "PUT", "PATCH", "DELETE", "GET", "HEAD", "OPTIONS", "post"]),
    st.text(st.sampled_from(string.ascii_uppercase + "-_"), min_size=1, max_size=12),
)
PATHS = st.one_of(
    st.sampled_from(["/echo", "/items", "/items/1", "/items/x", "/", "/echo/", "//echo"]),
    st.builds(lambda tail: "/items/" + tail, st.text(min_size=1, max_size=30)),
    st.builds(lambda tail: "/" + tail, st.text(max_size=60)),
    st.builds(lambda n: f"/items/{n}", st.integers(min_value=-(10**30), max_value=10**30)),
)
# A URI's query is ASCII (RFC 3986: anything else percent-encoded). Raw non-UTF-8 bytes make
# Starlette's trailing-slash redirect fail with a 500, with or without this middleware.
QUERIES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(
    str.encode
)
GUARDED = {"POST", "PUT", "PATCH", "DELETE"}


def test_any_method_and_path_is_never_a_500_and_runs_at_most_once(tmp_path: Path) -> None:
    with harness(tmp_path) as h:

        @EXAMPLES
        @given(
            method=METHODS,
            path=PATHS,
            query=QUERIES,
            body=st.binary(max_size=30),
            keyed=st.booleans(),
        )
        def check(method: str, path: str, query: bytes, body: bytes, keyed: bool) -> None:
            assume("\x00" not in path)
            caller = new_caller()
            headers = [caller_header(caller)] + ([(KEY, b"the-key")] if keyed else [])
            replies = [h.call(method, path, headers, chunks=[body], query=query) for _ in range(2)]
            for reply in replies:
                if reply.header(b"content-type") == PROBLEM.encode():
                    assert reply.problem() == "missing-key"
            if keyed and method in GUARDED:
                first, again = replies
                assert h.runs(caller) <= 1
                if first.status in REFUSED_BEFORE_THE_ENDPOINT:
                    # No route, not this method, a refused request: nothing ran, nothing recorded.
                    assert not again.replayed, (first, again)
                elif 200 <= first.status < 500 and first.body:
                    # Recorded (2xx and other 4xx alike): the repeat is the same answer.
                    assert again.replayed, (first, again)
                    assert (again.status, again.body) == (first.status, first.body)

        check()


def test_method_the_route_does_not_accept_is_405_not_missing_key(tmp_path: Path) -> None:
    with harness(tmp_path) as h:
        reply = h.call("PUT", "/echo", [caller_header(new_caller())], chunks=[b"{}"])
    assert reply.status == 405, reply


# ---------------------------------------------------------------- callers


CALLERS = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters=","),
    min_size=1,
    max_size=300,
)


def test_a_lone_surrogate_in_a_json_body_is_a_422_not_a_500(tmp_path: Path) -> None:
    app = create_example_app(f"sqlite:///{tmp_path / 'example.db'}")
    headers = [caller_header(new_caller()), (KEY, b"k"), (b"content-type", b"application/json")]
    with running(app) as portal:
        replies = [
            portal.call(lambda: call(app, "POST", "/tickets", headers, [b'{"title": "\\ud800"}']))
            for _ in range(2)
        ]
    assert [reply.status for reply in replies] == [422, 422], replies
    assert not replies[1].replayed  # a refusal: nothing ran, nothing recorded


def test_one_callers_key_never_replays_to_another_caller(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'example.db'}"
    app = create_example_app(url)
    with running(app) as portal:

        def post(caller: str, key: str, title: str) -> Reply:
            headers = [
                (b"x-caller", caller.encode("latin-1")),
                (KEY, key.encode()),
                (b"content-type", b"application/json"),
            ]
            body = json.dumps({"title": title}).encode()
            reply: Reply = portal.call(
                lambda: call(app, "POST", "/tickets", headers, chunks=[body])
            )
            assert reply.status != 500, reply
            assert not reply.raised, reply
            return reply

        @EXAMPLES
        @given(
            callers=st.lists(CALLERS, min_size=2, max_size=2, unique=True),
            key=st.text(VISIBLE, min_size=1, max_size=64),
            # Any text a JSON body can carry: no NUL, no lone surrogate (not Unicode text;
            # FastAPI answers 422 for it, before the endpoint).
            title=st.text(
                st.characters(exclude_characters="\x00", exclude_categories=["Cs"]),
                min_size=1,
                max_size=50,
            ),
        )
        def check(callers: list[str], key: str, title: str) -> None:
            key = f"{uuid.uuid4().hex}-{key}"
            alice, bob = callers
            first = post(alice, key, title)
            assert first.status == 201, first
            other = post(bob, key, title)
            assert other.status == 201, other
            assert not other.replayed
            assert json.loads(other.body)["id"] != json.loads(first.body)["id"]
            again = post(alice, key, title)
            assert again.replayed
            assert again.body == first.body

        check()


def test_a_caller_named_like_a_long_callers_digest_gets_no_replay(tmp_path: Path) -> None:
    long_caller = "tenant-" + "x" * 300
    digest = hashlib.sha256(long_caller.encode()).hexdigest()
    with harness(tmp_path) as h:
        first = h.call(headers=[(KEY, b"k"), caller_header(long_caller)], chunks=[b"{}"])
        other = h.call(headers=[(KEY, b"k"), caller_header(digest)], chunks=[b"{}"])
    assert first.status == 200
    assert not other.replayed, "one caller got another's response"


# ---------------------------------------------------------------- the example service


def test_example_service_huge_ticket_id_is_not_a_500(tmp_path: Path) -> None:
    app = create_example_app(f"sqlite:///{tmp_path / 'example.db'}")
    with running(app) as portal:
        headers = [(KEY, b"k"), (b"content-type", b"application/json")]
        reply = portal.call(
            lambda: call(
                app,
                "POST",
                f"/tickets/{2**70}/emails",
                headers,
                chunks=[b'{"recipient": "ops@example.com"}'],
            )
        )
    assert reply.status != 500, reply


EXAMPLE_TABLES = ("example_emails", "example_tickets", "idempotency_records")


async def drop_example_tables(url: str) -> None:
    """Leave the database as the other tests expect it: none of the example's tables."""
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        for table in (*EXAMPLE_TABLES, "idempotency_mw_alembic_version"):
            await conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
    await engine.dispose()


@pytest.mark.servers
@pytest.mark.parametrize(
    ("body", "caller"),
    [
        pytest.param({"title": "printer\u0000fire"}, "alice", id="nul-in-title"),
        pytest.param({"title": "printer on fire"}, "c" * 300, id="long-caller"),
    ],
)
def test_example_service_on_postgresql_is_not_a_500(body: dict[str, str], caller: str) -> None:
    require_server(POSTGRESQL_URL)
    with start_blocking_portal() as portal:
        portal.call(drop_example_tables, POSTGRESQL_URL)
    try:
        app = create_example_app(POSTGRESQL_URL)
        with running(app) as portal:
            headers = [
                (KEY, b"k"),
                (b"x-caller", caller.encode()),
                (b"content-type", b"application/json"),
            ]
            reply = portal.call(
                lambda: call(app, "POST", "/tickets", headers, [json.dumps(body).encode()])
            )
    finally:
        with start_blocking_portal() as portal:
            portal.call(drop_example_tables, POSTGRESQL_URL)
    assert reply.status != 500, reply


@pytest.mark.servers
def test_example_service_on_postgresql_ticket_id_beyond_int32_is_not_a_500() -> None:
    require_server(POSTGRESQL_URL)
    with start_blocking_portal() as portal:
        portal.call(drop_example_tables, POSTGRESQL_URL)
    try:
        app = create_example_app(POSTGRESQL_URL)
        with running(app) as portal:
            headers = [(KEY, b"k"), (b"content-type", b"application/json")]
            body = b'{"recipient": "ops@example.com"}'
            reply = portal.call(
                lambda: call(app, "POST", f"/tickets/{2**31}/emails", headers, [body])
            )
    finally:
        with start_blocking_portal() as portal:
            portal.call(drop_example_tables, POSTGRESQL_URL)
    assert reply.status != 500, reply


# ---------------------------------------------------------------- keys in the database


@pytest.mark.anyio
async def test_keys_and_scopes_differing_by_trailing_spaces_are_different_records(
    store: Any,
) -> None:
    fingerprint = "f" * 64
    for scope, key in [("alice", "k"), ("alice ", "k"), ("bob", "k "), ("bob", "k")]:
        claim = await store.claim(scope, key, fingerprint, ttl=60, lease=10)
        assert claim.outcome.value == "acquired", (scope, key, claim)


# ---------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def example_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The example ticket service under uvicorn, on SQLite; its base URL."""
    database = tmp_path_factory.mktemp("example") / "example.db"
    with ServerProcess(
        "example_app.app:create_app",
        {"EXAMPLE_DATABASE_URL": f"sqlite:///{database}"},
        ready_path="/tickets",
    ) as server:
        server.wait_ready()
        yield server.url


#: What uvicorn answers, itself, to a request its HTTP parser refuses.
UVICORN_REFUSAL = "Invalid HTTP request received."


def within_sqlite_integers(case: schemathesis.Case[Any]) -> bool:
    """Whether the case's ticket id fits SQLite's INTEGER (see the test above)."""
    value = (case.path_parameters or {}).get("ticket_id")
    try:
        number = int(str(value))
    except ValueError:
        return True
    return -(2**63) <= number < 2**63


def fuzz(
    operation: schemathesis.APIOperation[Any, Any, Any, Any],
    mode: schemathesis.GenerationMode,
    base_url: str,
    *,
    keyed: bool,
) -> Counter[int]:
    """Send schemathesis's cases for one operation; check each answer; count the statuses."""
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case[Any]) -> None:
        assume(within_sqlite_integers(case))
        headers = dict(case.headers or {})
        if not keyed:
            # Neither of the headers a key comes in (the schema documents both).
            unkeyed = {"idempotency-key", "repeatability-request-id"}
            headers = {k: v for k, v in headers.items() if k.lower() not in unkeyed}
        case.headers = CaseInsensitiveDict(headers)
        response = case.call(base_url=base_url)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        # Header values come as lists (a name may repeat).
        if response.headers.get("content-type") == [PROBLEM]:
            problem = response.json()
            assert problem["status"] == response.status_code
            # The middleware's problems, or the service's own 422s (a refund that needs a
            # person's approval, a mailbox that refuses mail), which a fuzzer can reach.
            assert problem["type"].startswith("urn:idempotency-mw:problem:") or (
                problem["type"] in (MAILBOX_UNAVAILABLE, REFUND_NEEDS_APPROVAL)
                and response.status_code == 422
            ), problem
        if response.text == UVICORN_REFUSAL:
            # A header value h11 refuses (negative cases make them): uvicorn answers 400 in
            # plain text before any application, ours or the service's, sees the request.
            assert response.status_code == 400
            return
        if not keyed and operation.method.upper() == "POST":
            assert response.status_code == 400
            assert response.json()["type"].endswith(":missing-key")

    try:
        check()
    except Unsatisfiable:
        # Nothing to generate: GET /tickets has no parameter to make invalid.
        assert mode is schemathesis.GenerationMode.NEGATIVE
    return statuses


@pytest.mark.parametrize("keyed", [True, False], ids=["with-key", "without-key"])
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_example_service_schema_fuzzing_never_gives_a_500(
    example_service: str, mode: schemathesis.GenerationMode, keyed: bool
) -> None:
    schema = schemathesis.openapi.from_url(example_service + "/openapi.json")
    results = list(schema.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), results
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert {(op.method.upper(), op.path) for op in operations} >= {
        ("POST", "/tickets"),
        ("POST", "/tickets/{ticket_id}/emails"),
    }
    statuses: Counter[int] = Counter()
    for operation in operations:
        statuses += fuzz(operation, mode, example_service, keyed=keyed)
    assert statuses, "schemathesis sent nothing"
    if keyed and mode is schemathesis.GenerationMode.POSITIVE:
        assert statuses[201] + statuses[202] > 0, statuses
