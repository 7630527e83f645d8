"""What a user sees of the stores' packaging and failures: lazy imports, one-line errors."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount

from idempotency_mw import RedisStore, SQLStore, Store, StoreError, install
from idempotency_mw.operator import cli
from idempotency_mw.operator.panel import panel
from tests.support.apps import client_for
from tests.support.ports import free_ports

pytestmark = pytest.mark.anyio


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_importing_the_package_loads_no_backend_library() -> None:
    result = python(
        "import sys, idempotency_mw, idempotency_mw.values.exceptions, idempotency_mw.testing\n"
        "loaded = {m.partition('.')[0] for m in sys.modules}\n"
        "print(sorted(loaded & {'sqlalchemy', 'alembic', 'redis', 'asyncpg', 'asyncmy'}))"
    )
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize(
    ("store", "missing", "extra"),
    [("SQLStore", "sqlalchemy", "sql"), ("RedisStore", "redis", "redis")],
)
def test_a_store_without_its_extra_names_the_install_command(
    store: str, missing: str, extra: str
) -> None:
    result = python(
        f"import sys; sys.modules[{missing!r}] = None\nfrom idempotency_mw import {store}"
    )
    assert result.returncode == 1
    assert (
        f"ImportError: {store} needs {missing}: install the [{extra}] extra "
        f"(pip install 'idempotency-mw[{extra}]', or from a checkout: pip install -e '.[{extra}]')"
    ) in result.stderr


@pytest.mark.parametrize(
    ("url", "missing", "extra"),
    [
        ("postgresql://u@127.0.0.1/db", "asyncpg", "postgresql"),
        ("mysql://u@127.0.0.1/db", "asyncmy", "mysql"),
        ("mariadb://u@127.0.0.1/db", "asyncmy", "mysql"),
        ("sqlite:///idempotency.db", "aiosqlite", "sql"),
    ],
)
def test_a_sql_store_without_its_driver_names_the_extra(url: str, missing: str, extra: str) -> None:
    # An ImportError (a ModuleNotFoundError still, for callers that look for one) that
    # says what to install.
    result = python(
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from idempotency_mw import SQLStore\n"
        "try:\n"
        f"    SQLStore({url!r})\n"
        "except ImportError as exc:\n"
        "    print(exc.name, exc)"
    )
    backend = url.partition(":")[0]
    assert result.stdout.strip() == (
        f"{missing} SQLStore on {backend} needs {missing}: install the [{extra}] extra "
        f"(pip install 'idempotency-mw[{extra}]', or from a checkout: pip install -e '.[{extra}]')"
    ), result.stderr


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A TCP port whose server accepts connections and never answers."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def failure_of(store: Store, operation: str) -> str:
    """The message of the StoreError that ``operation`` on ``store`` raises."""
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "claim": lambda: store.claim("s", "k", "f", ttl=60, lease=60),
        "renew": lambda: store.renew("s", "k", "t" * 32, lease=60),
        "release": lambda: store.release("s", "k", "t" * 32),
    }
    try:
        with pytest.raises(StoreError) as caught:
            await calls[operation]()
    finally:
        await store.aclose()
    return str(caught.value)


async def test_a_store_error_names_the_operation_the_store_and_the_cause() -> None:
    message = await failure_of(SQLStore("postgresql://app:secret@127.0.0.1:1/db"), "claim")
    assert message.startswith(
        "claim on SQLStore(postgresql+asyncpg://app:***@127.0.0.1:1/db) failed: "
    )
    assert "refused" in message.lower()
    message = await failure_of(SQLStore("mysql://root@127.0.0.1:1/db"), "release")
    assert message.startswith("release on SQLStore(mysql+asyncmy://root@127.0.0.1:1/db) failed: ")
    assert "2003" in message  # can't connect to the server


async def test_a_timeout_says_how_long_the_store_waited(silent_port: int) -> None:
    url = f"postgresql://app@127.0.0.1:{silent_port}/db"
    message = await failure_of(SQLStore(url, operation_timeout=0.3), "renew")
    assert message == (
        f"renew on SQLStore(postgresql+asyncpg://app@127.0.0.1:{silent_port}/db) "
        "failed: no answer within 0.3 s"
    )
    message = await failure_of(
        RedisStore(f"redis://:secret@127.0.0.1:{silent_port}/0", socket_timeout=0.3), "claim"
    )
    # redis-py's own socket timeout, in its words.
    assert message == (
        f"claim on RedisStore(redis://:***@127.0.0.1:{silent_port}/0) failed: "
        f"TimeoutError: Timeout reading from 127.0.0.1:{silent_port}"
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:in-login@127.0.0.1:{port}/db?password=in-query",
        "mysql://root:in-login@127.0.0.1:{port}/db?password=in-query",
        "redis://:in-login@127.0.0.1:{port}/0?password=in-query",
    ],
    ids=["postgresql", "mariadb", "redis"],
)
async def test_a_password_in_a_store_url_is_never_logged_or_shown(
    url: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # A real connection to a port nothing listens on: every store failure is logged (the
    # start, each request) and the operator's command prints it.
    url = url.format(port=free_ports(1)[0])
    store = RedisStore(url) if url.startswith("redis") else SQLStore(url)
    app = FastAPI()
    install(app, store=store)

    @app.post("/tickets")
    async def create() -> dict[str, int]:
        return {"id": 1}

    caplog.set_level(logging.DEBUG)
    async with LifespanManager(app), client_for(app) as client:
        answer = await client.post("/tickets", headers={"Idempotency-Key": "k"})
    operators = Starlette(routes=[Mount("/ops", panel(store))])
    transport = httpx.ASGITransport(app=operators)
    async with httpx.AsyncClient(transport=transport, base_url="http://ops.test") as client:
        page = await client.get("/ops/")
    code = await asyncio.to_thread(cli.main, ["stats", "--url", url])
    shown = capsys.readouterr()
    assert answer.status_code == 503
    assert page.status_code == 503
    assert code != 0
    assert "unreachable at start-up" in caplog.text
    assert "failed to claim key" in caplog.text
    for seen in (caplog.text, answer.text, page.text, shown.out, shown.err, repr(store)):
        assert "in-login" not in seen
        assert "in-query" not in seen
    assert ":***@127.0.0.1" in caplog.text
    assert "password=***" in caplog.text
