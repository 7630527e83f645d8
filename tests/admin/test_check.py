"""``idempotency-mw check`` and the start-up warnings: the settings of a store's own server that
lose records, read from servers started with them (Redis) or databases given them (PostgreSQL,
MariaDB); the app's clock against the server's, shifted in the app's process by libfaketime."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio
from asgi_lifespan import LifespanManager
from sqlalchemy import make_url

from idempotency_mw import RedisStore, SQLStore
from idempotency_mw.functions import IdempotentFunctions
from idempotency_mw.operator.cli import main
from idempotency_mw.stores.checks import findings
from idempotency_mw.values.findings import Severity
from tests.conftest import (
    MARIADB_URL,
    POSTGRESQL_URL,
    REQUIRE_SERVERS,
    SERVER_DATABASES,
    _new_server,
    require_redis_server,
    require_server,
)
from tests.support.apps import make_app
from tests.support.faults import MariaDBServer, free_port
from tests.support.readme import ROOT
from tests.support.redis_servers import RedisCluster, RedisSentinel, start_server, stop_servers
from tests.support.scratch import run_on_server, scratch_database

pytestmark = pytest.mark.anyio

DURABLE = ("--appendonly", "yes")
#: As managed servers do: CONFIG is not a command there.
RENAMED_CONFIG = ("--rename-command", "CONFIG", "")


def check(capsys: pytest.CaptureFixture[str], url: str) -> tuple[int, str, str]:
    """What ``idempotency-mw check --store <url>`` exits with and prints."""
    code = main(["check", "--store", url])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ours(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """The package's log records: their levels and messages."""
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "idempotency_mw"]


def redis_started(folder: Path, *options: str) -> Iterator[str]:
    """The URL of a ``redis-server`` of the test's own, started with ``options``."""
    require_redis_server()
    node = start_server(folder / "redis", free_port(), *options)
    try:
        yield f"redis://127.0.0.1:{node.port}/0"
    finally:
        stop_servers([node], folder / "redis")


EVICTING = ["volatile-lru", "allkeys-lru"]


@pytest.fixture(params=EVICTING)
def evicting_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A Redis that evicts keys under memory pressure, and keeps them on disk otherwise."""
    yield from redis_started(tmp_path, "--maxmemory-policy", request.param, *DURABLE)


@pytest.mark.parametrize("policy", EVICTING)
async def test_check_names_an_evicting_policy_and_its_fix(
    policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url in redis_started(tmp_path, "--maxmemory-policy", policy, *DURABLE):
        code, out, err = await asyncio.to_thread(check, capsys, url)
    assert code == 1, (out, err)
    [line] = out.splitlines()
    assert f"maxmemory-policy is {policy}" in line
    assert "noeviction" in line
    assert "can lose records" in err


async def test_the_middleware_warns_of_an_evicting_policy_once(
    evicting_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore(evicting_redis)
    app = make_app(store)
    with caplog.at_level(logging.INFO, "idempotency_mw"):
        async with LifespanManager(app):
            pass
        # A second start-up in the process (a TestClient entered again) says nothing new.
        async with LifespanManager(make_app(store)):
            pass
    warnings = [message for level, message in ours(caplog) if level >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "maxmemory-policy is" in warnings[0]
    assert "noeviction" in warnings[0]


async def test_server_checks_false_turns_the_warnings_off(
    evicting_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore(evicting_redis)
    with caplog.at_level(logging.INFO, "idempotency_mw"):
        async with LifespanManager(make_app(store, server_checks=False)):
            pass
        await IdempotentFunctions(store, server_checks=False).startup()
    assert not [message for level, message in ours(caplog) if level >= logging.WARNING]
    # Not checked yet, so the next entry that checks warns.
    with caplog.at_level(logging.INFO, "idempotency_mw"):
        await IdempotentFunctions(store).startup()
    assert "maxmemory-policy is" in caplog.text
    await store.aclose()


async def test_an_mcp_servers_lifespan_warns_too(
    evicting_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    from idempotency_mw.mcp import IdempotentTools

    store = RedisStore(evicting_redis)
    with caplog.at_level(logging.INFO, "idempotency_mw"):
        async with IdempotentTools(store).lifespan(None):
            pass
    await store.aclose()
    warnings = [message for level, message in ours(caplog) if level >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "maxmemory-policy is" in warnings[0]


@pytest.mark.parametrize(
    ("options", "exit_code", "said"),
    [
        ((), 1, 'appendonly is no, and no snapshots (save "")'),
        (("--save", "60 1"), 1, 'appendonly is no (snapshots: save "60 1")'),
        (("--maxmemory-policy", "noeviction", *DURABLE), 0, "nothing found"),
    ],
    ids=["no-persistence", "snapshots-only", "noeviction-appendonly"],
)
async def test_check_of_redis_persistence(
    options: tuple[str, ...],
    exit_code: int,
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # start_server's own default: --save "" --appendonly no, which these options override.
    for url in redis_started(tmp_path, *options):
        code, out, err = await asyncio.to_thread(check, capsys, url)
        assert code == exit_code, (out, err)
        assert said in out


async def test_a_managed_redis_that_refuses_config_is_read_through_info(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url in redis_started(tmp_path, "--maxmemory-policy", "volatile-ttl", *RENAMED_CONFIG):
        code, out, err = await asyncio.to_thread(check, capsys, url)
    assert code == 1, (out, err)
    assert "maxmemory-policy is volatile-ttl" in out
    assert "save unknown: the server refuses CONFIG" in out
    for url in redis_started(tmp_path / "durable", *DURABLE, *RENAMED_CONFIG):
        code, out, err = await asyncio.to_thread(check, capsys, url)
    assert code == 0, (out, err)


async def test_a_server_that_refuses_info_is_a_note_and_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for url in redis_started(tmp_path, "--rename-command", "INFO", "", *DURABLE):
        store = RedisStore(url)
        with caplog.at_level(logging.INFO, "idempotency_mw"):
            async with LifespanManager(make_app(store)):
                pass
    assert not [message for level, message in ours(caplog) if level >= logging.WARNING]
    assert "note: INFO is refused" in caplog.text


async def test_a_sentinels_primary_without_a_replica_is_a_finding(
    redis_sentinel: RedisSentinel,
) -> None:
    watcher = redis.asyncio.Sentinel([redis_sentinel.sentinel_address])  # type: ignore[no-untyped-call, unused-ignore]
    master = watcher.master_for(redis_sentinel.name)
    try:
        found = await findings(RedisStore(client=master))
    finally:
        await master.aclose()
        for client in watcher.sentinels:
            await client.aclose()
    assert [f.setting for f in found if f.setting == "replicas"] == ["replicas"]


def test_a_cluster_without_replicas_is_a_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_redis_server()
    with RedisCluster.start(tmp_path / "cluster", size=3, replicas=0) as cluster:
        # The command is given one node's URL: it finds the cluster, and reads every primary.
        code, out, err = check(capsys, cluster.url)
    assert code == 1, (out, err)
    assert "replicas is none for 3 of 3 primaries" in out


async def test_a_cluster_with_replicas_has_them(redis_cluster: RedisCluster) -> None:
    store = RedisStore(redis_cluster.url, cluster=True)
    try:
        found = await findings(store)
    finally:
        await store.aclose()
    assert "replicas" not in {finding.setting for finding in found}
    assert "appendonly" in {finding.setting for finding in found}  # started without


async def test_a_redis_of_its_own_needs_no_replica(tmp_path: Path) -> None:
    for url in redis_started(tmp_path, *DURABLE):
        store = RedisStore(url)
        assert await findings(store) == ()
        await store.aclose()


# ---------------------------------------------------------------- SQL databases


def test_synchronous_commit_off_on_the_database(capsys: pytest.CaptureFixture[str]) -> None:
    require_server(POSTGRESQL_URL)
    with scratch_database(POSTGRESQL_URL, "check") as url:
        run_on_server(url, f"ALTER DATABASE {make_url(url).database} SET synchronous_commit = off")
        code, out, err = check(capsys, url)
    assert code == 1, (out, err)
    [line] = out.splitlines()
    assert "synchronous_commit is off" in line
    assert "synchronous_commit = on" in line


@pytest.mark.parametrize("setting", ["statement_timeout", "idle_in_transaction_session_timeout"])
async def test_a_timeout_shorter_than_the_operation_timeout(setting: str) -> None:
    require_server(POSTGRESQL_URL)
    # Two seconds: the check's own statements, under the same timeout, finish well within it.
    url = f"{POSTGRESQL_URL}?{setting}=2000"
    store = SQLStore(url)
    try:
        [found] = await findings(store)
    finally:
        await store.aclose()
    assert (found.setting, found.found, found.severity) == (setting, "2 s", Severity.RISK)
    # Longer than the operation timeout, it cuts nothing the store would not give up first.
    patient = SQLStore(url, operation_timeout=1.5)
    try:
        assert await findings(patient) == ()
    finally:
        await patient.aclose()


def test_innodb_flush_log_at_trx_commit_other_than_1(capsys: pytest.CaptureFixture[str]) -> None:
    with _new_server(lambda: MariaDBServer("--innodb-flush-log-at-trx-commit=2")) as server:
        code, out, err = check(capsys, server.url)
    assert code == 1, (out, err)
    [line] = out.splitlines()
    assert "innodb_flush_log_at_trx_commit is 2" in line
    assert "innodb_flush_log_at_trx_commit = 1" in line


async def test_mariadbs_statement_time_limit() -> None:
    require_server(MARIADB_URL)
    store = SQLStore(f"{MARIADB_URL}?init_command=SET SESSION max_statement_time=2")
    try:
        [found] = await findings(store)
    finally:
        await store.aclose()
    assert (found.setting, found.found) == ("max_statement_time", "2 s")


async def test_sqlite_synchronous_normal(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    durable, quick = SQLStore(url), SQLStore(url, sqlite_synchronous="NORMAL")
    try:
        assert await findings(durable) == ()
        [found] = await findings(quick)
    finally:
        await durable.aclose()
        await quick.aclose()
    assert (found.setting, found.found) == ("synchronous", "1")


# ---------------------------------------------------------------- the app's clock


def libfaketime() -> str:
    """Debian's libfaketime, which shifts the clock of the process it is preloaded into."""
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        message = "libfaketime is not installed (Debian: libfaketime)"
        if REQUIRE_SERVERS:
            pytest.fail(message + " (IDEMPOTENCY_REQUIRE_SERVERS=1)")
        pytest.skip(message)
    return found[0]


def with_clock(shift: str, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run in a process whose clock is ``shift`` seconds from the machine's (the
    store's server keeps the machine's)."""
    env = {**os.environ, "LD_PRELOAD": libfaketime(), "FAKETIME": shift}
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def check_with_clock(url: str, shift: str) -> subprocess.CompletedProcess[str]:
    """``idempotency-mw check --store <url>`` run by an app whose clock is ``shift`` seconds
    from the store's."""
    return with_clock(
        shift, str(Path(sys.executable).parent / "idempotency-mw"), "check", "--store", url
    )


#: An app's start-up (the middleware's lifespan) on the store at ``sys.argv[1]``, its log on
#: stdout.
STARTUP = """
import asyncio, logging, sys
from asgi_lifespan import LifespanManager
from idempotency_mw import RedisStore
from tests.support.apps import make_app

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(message)s")


async def main() -> None:
    store = RedisStore(sys.argv[1])
    async with LifespanManager(make_app(store)):
        pass
    await store.aclose()


asyncio.run(main())
"""


@pytest.fixture(params=["redis", *SERVER_DATABASES])
def clocked_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a store whose server has a clock of its own, and nothing else to find."""
    if request.param in SERVER_DATABASES:
        url: str = SERVER_DATABASES[request.param]
        require_server(url)
        yield url
        return
    yield from redis_started(tmp_path, "--maxmemory-policy", "noeviction", *DURABLE)


@pytest.mark.parametrize(("shift", "side"), [("-30", "behind"), ("+30", "ahead of")])
def test_an_app_clock_apart_from_the_stores_is_a_finding(
    clocked_store: str, shift: str, side: str
) -> None:
    ran = check_with_clock(clocked_store, shift)
    assert ran.returncode == 1, (ran.stdout, ran.stderr)
    [line] = ran.stdout.splitlines()
    said = re.search(rf"the app's clock is ([0-9.]+) s {side} the store's", line)
    assert said, line
    # The server reads its clock a moment after the app's first reading.
    assert 29 <= float(said[1]) <= 30.1, line
    assert "NTP" in line
    # Within a second of the store's, the same app finds nothing.
    near = check_with_clock(clocked_store, "+0.5")
    assert near.returncode == 0, (near.stdout, near.stderr)
    assert "nothing found" in near.stdout


def test_sqlite_keeps_the_apps_own_clock(tmp_path: Path) -> None:
    database = tmp_path / "records.db"
    database.touch()
    ran = check_with_clock(f"sqlite:///{database}", "-30")
    assert ran.returncode == 0, (ran.stdout, ran.stderr)
    assert "nothing found" in ran.stdout


def test_an_app_started_with_its_clock_behind_the_stores_warns_once(tmp_path: Path) -> None:
    for url in redis_started(tmp_path, "--maxmemory-policy", "noeviction", *DURABLE):
        started = with_clock("-30", sys.executable, "-c", STARTUP, url)
    assert started.returncode == 0, started.stderr
    warnings = [line for line in started.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, started.stdout
    assert "the app's clock is" in warnings[0]
    assert "behind the store's" in warnings[0]
