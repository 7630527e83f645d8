"""A store used from one event loop after another, as a ``TestClient`` without ``with`` does
(FastAPI's own testing example): each request runs in a loop of its own, closed at its end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    REDIS_URL,
    SERVER_DATABASES,
    forget_redis_prefix,
    fresh_sql_store,
    redis_prefix,
    require_server,
)


def service(kind: str, url: str, *keys: str) -> dict[str, Any]:
    """What :mod:`tests.support.loops_agent` reports of ``keys`` sent to a service on
    ``url``'s store."""
    prefix = redis_prefix("loops")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.loops_agent", kind, url, *keys],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "LOOPS_REDIS_PREFIX": prefix},
        )
    finally:
        if url.startswith("redis"):
            forget_redis_prefix(prefix)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def emptied(url: str) -> str:
    async def empty() -> None:
        await (await fresh_sql_store(url)).aclose()

    asyncio.run(empty())
    return url


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb", "redis"])
def test_a_store_made_from_a_url_answers_every_loop(backend: str, tmp_path: Path) -> None:
    if backend == "redis":
        require_server(REDIS_URL)
        url = REDIS_URL
    elif backend == "sqlite":
        url = emptied(f"sqlite:///{tmp_path / 'idempotency.db'}")
    else:
        require_server(SERVER_DATABASES[backend])
        url = emptied(SERVER_DATABASES[backend])
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    report = service("url", url, a, a, b, b)
    assert report == {"statuses": [201] * 4, "runs": 2, "failures": []}


@pytest.mark.parametrize("backend", list(SERVER_DATABASES))
def test_an_engine_with_a_pool_fails_as_the_store_and_names_the_way_out(backend: str) -> None:
    require_server(SERVER_DATABASES[backend])
    url = emptied(SERVER_DATABASES[backend])
    # The engine's pool hands the second loop a connection of the first: 503, not 500.
    report = service("engine", url, "a", "b")
    assert report["statuses"] == [201, 503]
    assert "give the engine poolclass=NullPool" in report["failures"][0]
    # Without a pool, as SQLAlchemy advises, every loop gets its answer.
    assert service("engine-nullpool", url, "c", "c", "d") == {
        "statuses": [201] * 3,
        "runs": 2,
        "failures": [],
    }
