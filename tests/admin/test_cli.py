"""The operator's commands (inspect, release, stats, purge, --version) on every store.

Records are made by the stores themselves, as the middleware would make them; the commands
then read them as an operator would, in text and in JSON.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from idempotency_mw import RedisStore, Store, StoredResponse
from idempotency_mw.operator.cli import main
from idempotency_mw.values.records import ClaimOutcome
from tests.conftest import (
    MARIADB_URL,
    PERSISTENT_STORES,
    REDIS_URL,
    SERVER_DATABASES,
    fresh_sql_store,
    redis_prefix,
    require_server,
)
from tests.support.redis_servers import RedisCluster
from tests.support.scratch import scratch_database

BODY = b'{"id": 17, "title": "Printer on fire"}'
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), BODY)
HOUR = 3600.0


@dataclass
class Target:
    """A store with records, and how the command line names it."""

    name: str
    url: str
    store: Store
    options: list[str]

    async def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        """The command's exit code and output (in a thread: it runs its own event loop)."""
        command, *rest = args
        code = await asyncio.to_thread(main, [command, "--store", self.url, *self.options, *rest])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    async def json(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
        code, out, err = await self.run(capsys, *args, "--json")
        assert err == "" or code != 0, err
        return code, json.loads(out)


@pytest.fixture(params=[*PERSISTENT_STORES, "redis-cluster"])
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Target]:
    name: str = request.param
    if name == "redis-cluster":
        # The command is given one node's URL, as an operator would: it finds the others.
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        prefix = f"test-cli-{uuid.uuid4().hex}:"
        cluster_store = RedisStore(cluster.url, cluster=True, prefix=prefix)
        yield Target(name, cluster.url, cluster_store, ["--prefix", prefix])
        await cluster_store.aclose()  # the cluster is the session's own: its keys go with it
        return
    if name == "redis":
        require_server(REDIS_URL)
        prefix = redis_prefix("cli")
        redis_store = RedisStore(REDIS_URL, prefix=prefix)
        yield Target(name, REDIS_URL, redis_store, ["--prefix", prefix])
        keys = [k async for k in redis_store.client.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis_store.client.delete(*keys)
        await redis_store.aclose()
        return
    url = f"sqlite:///{tmp_path / 'idempotency.db'}" if name == "sqlite" else SERVER_DATABASES[name]
    if name != "sqlite":
        require_server(url)
    sql_store = await fresh_sql_store(url)
    yield Target(name, url, sql_store, [])
    await sql_store.aclose()


def fingerprint(key: str) -> str:
    """The request hash the tests give a key's request (a sha256, as the middleware's)."""
    return hashlib.sha256(key.encode()).hexdigest()


async def claim(store: Store, key: str, *, scope: str = "", lease: float = HOUR) -> str:
    made = await store.claim(scope, key, fingerprint(key), ttl=HOUR, lease=lease)
    assert made.outcome is ClaimOutcome.ACQUIRED
    assert made.token is not None
    return made.token


async def completed(store: Store, key: str, *, scope: str = "", ttl: float = HOUR) -> None:
    token = await claim(store, key, scope=scope)
    assert await store.complete(scope, key, token, RESPONSE, ttl=ttl)


def _time(text: str | None) -> datetime:
    assert text is not None
    return datetime.fromisoformat(text)


def near(moment: datetime, expected: datetime, slack: float = 5.0) -> bool:
    return abs((moment - expected).total_seconds()) <= slack


# --- inspect ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_inspect_shows_a_record_in_progress_and_completed(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await claim(target.store, "order-17", scope="alice", lease=60)
    code, shown = await target.json(capsys, "inspect", "order-17", "--scope", "alice")
    assert code == 0
    now = _time(shown["now"])
    assert near(now, datetime.now(UTC))
    assert shown["status"] == "in_progress"
    assert shown["request_hash"] == fingerprint("order-17")
    assert shown["expired"] is False
    assert near(_time(shown["lease_expires_at"]), now + timedelta(seconds=60))
    assert near(_time(shown["expires_at"]), now + timedelta(hours=1))
    assert (shown["response_status"], shown["response_size"]) == (None, None)
    if target.name.startswith("redis"):  # the Redis store keeps no creation time
        assert shown["created_at"] is None
    else:
        assert near(_time(shown["created_at"]), now)

    await completed(target.store, "order-18", scope="alice")
    code, shown = await target.json(capsys, "inspect", "order-18", "--scope", "alice")
    assert code == 0
    assert shown["status"] == "completed"
    assert (shown["response_status"], shown["response_size"]) == (201, len(BODY))
    assert "body_base64" not in shown

    code, out, err = await target.run(capsys, "inspect", "order-18", "--scope", "alice")
    assert (code, err) == (0, "")
    assert "completed" in out
    assert f"201, {len(BODY)} bytes" in out
    assert "Printer" not in out  # never the body unless asked


@pytest.mark.anyio
async def test_inspect_prints_the_body_only_when_asked(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await completed(target.store, "order-17")
    code, shown = await target.json(capsys, "inspect", "order-17", "--body")
    assert code == 0
    assert shown["body_base64"] == "eyJpZCI6IDE3LCAidGl0bGUiOiAiUHJpbnRlciBvbiBmaXJlIn0="
    code, out, _ = await target.run(capsys, "inspect", "order-17", "--body")
    assert code == 0
    assert out.endswith(BODY.decode())


@pytest.mark.anyio
async def test_inspect_of_a_key_without_record_exits_1(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await target.run(capsys, "inspect", "never-sent", "--json")
    assert code == 1
    assert json.loads(out) is None
    assert err.startswith("idempotency-mw: no record of key 'never-sent' in scope ''")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("command", "said"), [("inspect", ""), ("release", ": nothing to release")]
)
async def test_inspect_and_release_without_scope_name_the_scopes_that_hold_the_key(
    target: Target, capsys: pytest.CaptureFixture[str], command: str, said: str
) -> None:
    await completed(target.store, "order-17", scope="alice")
    await completed(target.store, "order-17", scope="bob")
    await completed(target.store, "order-18")
    # Another scope is another record.
    code, out, err = await target.run(capsys, command, "order-17")
    assert (code, out) == (1, "")
    if target.name.startswith("redis"):  # a record's name is a digest of scope and key
        assert err == (
            f"idempotency-mw: no record of key 'order-17' in scope ''{said} (Redis names "
            "records by a digest of scope and key: give the right --scope)\n"
        )
    else:
        assert err == (
            f"idempotency-mw: no record of key 'order-17' in scope ''{said}; the key has "
            "records in other scopes: 'alice', 'bob' (give one with --scope)\n"
        )
    code, out, err = await target.run(capsys, command, "order-18", "--scope", "alice")
    assert code == 1
    if not target.name.startswith("redis"):
        assert err.endswith("records in other scopes: '' (give one with --scope)\n")


@pytest.mark.anyio
async def test_inspect_finds_keys_stored_as_their_digest(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    long_key, long_scope = "k" * 300, "tenant " * 50
    await completed(target.store, long_key, scope=long_scope)
    code, shown = await target.json(capsys, "inspect", long_key, "--scope", long_scope)
    assert code == 0
    assert shown["status"] == "completed"


@pytest.mark.anyio
async def test_inspect_says_an_expired_record_is_treated_as_absent(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    if target.name.startswith("redis"):
        pytest.skip("Redis deletes a record when its TTL ends")
    await completed(target.store, "order-17", ttl=0.001)
    await asyncio.sleep(0.05)
    code, shown = await target.json(capsys, "inspect", "order-17")
    assert code == 0
    assert shown["expired"] is True


# --- release ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_release_frees_a_key_stuck_in_progress(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await claim(target.store, "order-17", scope="alice")
    other = await target.store.claim("alice", "order-17", "another-hash", ttl=HOUR, lease=HOUR)
    assert other.outcome is ClaimOutcome.MISMATCH

    code, out, err = await target.run(capsys, "release", "order-17", "--scope", "alice")
    assert (code, err) == (0, "")
    assert out == (
        "idempotency-mw: released key 'order-17' in scope 'alice' (it was in_progress): "
        "its next request runs again\n"
    )
    again = await target.store.claim("alice", "order-17", "another-hash", ttl=HOUR, lease=HOUR)
    assert again.outcome is ClaimOutcome.ACQUIRED


@pytest.mark.anyio
async def test_release_refuses_a_completed_record_unless_forced(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await completed(target.store, "order-17")
    code, shown = await target.json(capsys, "release", "order-17")
    assert code == 1
    assert shown["outcome"] == "refused"
    assert shown["record"]["status"] == "completed"
    code, out, err = await target.run(capsys, "release", "order-17")
    assert (code, out) == (1, "")
    assert err.startswith("idempotency-mw: key 'order-17' in scope '' is completed")
    assert "--force" in err
    replay = await target.store.claim("", "order-17", fingerprint("order-17"), ttl=HOUR, lease=HOUR)
    assert replay.outcome is ClaimOutcome.REPLAY

    code, shown = await target.json(capsys, "release", "order-17", "--force")
    assert (code, shown["outcome"]) == (0, "released")
    rerun = await target.store.claim("", "order-17", fingerprint("order-17"), ttl=HOUR, lease=HOUR)
    assert rerun.outcome is ClaimOutcome.ACQUIRED


@pytest.mark.anyio
async def test_release_of_an_unreplayable_record_says_retries_get_no_response(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    token = await claim(target.store, "too-large")
    assert await target.store.complete("", "too-large", token, None, ttl=HOUR)
    code, out, err = await target.run(capsys, "release", "too-large")
    assert (code, out) == (1, "")
    line = _one_line(err)
    assert "is unreplayable, not in progress: it ran, but its response was too large" in line
    assert "a release would let a retry run it again" in line


@pytest.mark.anyio
async def test_release_of_a_key_without_record_exits_1(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await target.run(capsys, "release", "never-sent")
    assert (code, out) == (1, "")
    assert err.startswith(
        "idempotency-mw: no record of key 'never-sent' in scope '': nothing to release"
    )
    assert "other scopes" not in err


@pytest.mark.parametrize(
    "command",
    ["migrate", "downgrade", "purge", "inspect", "release", "stats", "conformance", "panel"],
)
def test_every_command_names_its_store_with_store_and_takes_url_too(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--store URL, --url URL" in capsys.readouterr().out


# --- stats --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stats_counts_records_by_status(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await claim(target.store, "running-1")
    await asyncio.sleep(0.05)  # the oldest in progress is the first one
    await claim(target.store, "running-2")
    for key in ("done-1", "done-2", "done-3"):
        await completed(target.store, key)
    token = await claim(target.store, "too-large")
    assert await target.store.complete("", "too-large", token, None, ttl=HOUR)
    await completed(target.store, "expired", ttl=0.001)
    await asyncio.sleep(0.05)

    code, shown = await target.json(capsys, "stats")
    assert code == 0
    now = _time(shown["now"])
    assert near(now, datetime.now(UTC))
    assert shown["size_bytes"] > 0
    if target.name.startswith("redis"):  # the expired record is gone already; no creation time
        assert shown["by_status"] == {
            "in_progress": 2,
            "completed": 3,
            "unreplayable": 1,
            "committed": 0,
        }
        assert shown["total"] == 6
        assert (shown["expired"], shown["oldest_in_progress"], shown["fenced"]) == (None,) * 3
    else:
        assert shown["by_status"] == {
            "in_progress": 2,
            "completed": 4,
            "unreplayable": 1,
            "committed": 0,
        }
        assert shown["total"] == 7
        assert (shown["expired"], shown["fenced"]) == (1, 0)
        oldest = _time(shown["oldest_in_progress"])
        assert near(oldest, now)
        assert oldest < now - timedelta(seconds=0.1)

    code, out, err = await target.run(capsys, "stats")
    assert (code, err) == (0, "")
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.startswith("  "))
    assert lines["in_progress"].strip() == "2"
    assert "records" in out
    assert "expired, awaiting purge" in out


# --- purge --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_purge_deletes_what_stats_counts_as_expired(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await completed(target.store, "fresh")
    await completed(target.store, "expired", ttl=0.001)
    await asyncio.sleep(0.05)
    code, out, err = await target.run(capsys, "purge")
    assert (code, err) == (0, "")
    if target.name.startswith("redis"):
        assert out == "idempotency-mw: Redis expires records by itself (TTL): nothing to purge\n"
    else:
        assert out.startswith("idempotency-mw: purged 1 expired record in ")
    code, shown = await target.json(capsys, "stats")
    assert code == 0
    assert shown["total"] == 1
    assert shown["expired"] in (0, None)


# --- errors -------------------------------------------------------------------------------------


def _one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("idempotency-mw: ")
    return lines[0]


@pytest.fixture
def database_without_table(database_url: str) -> Iterator[str]:
    if database_url.startswith("sqlite"):
        Path(database_url.removeprefix("sqlite:///")).touch()
        yield database_url
        return
    with scratch_database(database_url, "cli") as url:
        yield url


@pytest.mark.parametrize(
    "command", [["inspect", "some-key"], ["release", "some-key"], ["stats"], ["purge"]]
)
def test_a_missing_table_names_the_migrate_command(
    database_without_table: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    name, *rest = command
    assert main([name, "--url", database_without_table, *rest]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "idempotency_records" in line
    assert "idempotency-mw migrate --store" in line


def test_purge_of_proofs_without_their_table_names_migrate_proofs(
    database_without_table: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["purge", "--proofs", "--url", database_without_table]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "the table 'idempotency_proofs' does not exist" in line
    assert "idempotency-mw migrate --proofs --store" in line


def test_a_missing_sqlite_file_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo.db"
    assert main(["stats", "--url", f"sqlite:///{missing}"]) == 2
    assert _one_line(capsys.readouterr().err) == f"idempotency-mw: no SQLite database at {missing}"
    assert not missing.exists()


@pytest.mark.parametrize(
    ("module", "url", "extra"),
    [
        ("asyncpg", "postgresql://app@127.0.0.1:1/app", "postgresql"),
        ("asyncmy", "mysql://app@127.0.0.1:1/app", "mysql"),
    ],
)
@pytest.mark.parametrize("command", [["migrate"], ["stats"], ["inspect", "k"], ["purge"]])
def test_a_missing_driver_names_the_extra_to_install(
    module: str,
    url: str,
    extra: str,
    command: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    name, *rest = command
    assert main([name, "--url", url, *rest]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == (
        f"idempotency-mw: this needs {module}: install the [{extra}] extra "
        f"(pip install 'idempotency-mw[{extra}]', or from a checkout: pip install -e '.[{extra}]')"
    )


@pytest.mark.parametrize("command", [["stats"], ["inspect", "k"], ["release", "k"]])
@pytest.mark.parametrize("url", ["nonsense", "oracle://x/y", "redis://host:notaport/0"])
def test_a_bad_url_is_one_line_and_exit_2(
    url: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    name, *rest = command
    assert main([name, "--url", url, *rest]) == 2
    _one_line(capsys.readouterr().err)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel does) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.parametrize("scheme", ["postgresql://app@", "mysql://app@", "redis://"])
def test_a_store_that_never_answers_times_out_in_one_line(
    scheme: str, silent_server: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{scheme}127.0.0.1:{silent_server}/0"
    assert main(["stats", "--url", url, "--timeout", "0.5"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == "idempotency-mw: the store did not answer within 0.5 s"


def test_an_unreachable_store_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--url", "redis://127.0.0.1:1/0", "k"]) == 1
    assert "Connect call failed" in _one_line(capsys.readouterr().err)


def test_version_is_the_installed_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"idempotency-mw {version('idempotency-mw')}\n"


def test_mariadb_migrations_print_no_server_warnings() -> None:
    """asyncmy logs each server note; MariaDB's "name ignored for PRIMARY key" is noise."""
    require_server(MARIADB_URL)
    with scratch_database(MARIADB_URL, "warnings") as url:
        for command in ("migrate", "downgrade"):
            result = subprocess.run(
                [sys.executable, "-m", "idempotency_mw.operator.cli", command, "--url", url],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert (result.returncode, result.stderr) == (0, ""), result.stderr
            assert result.stdout.startswith(f"idempotency-mw: {command} to ")


def test_migrate_a_redis_url_has_nothing_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--url", REDIS_URL]) == 0
    assert "nothing to migrate" in capsys.readouterr().out


# --- fenced commits -----------------------------------------------------------------------------


@pytest.fixture
def sql_target(target: Target) -> Target:
    """A SQL store's target: fenced commits take part in a SQL transaction."""
    if target.name.startswith("redis"):
        pytest.skip("fenced commits take part in a SQL transaction")
    return target


async def fenced(target: Target, key: str, *, settle: bool) -> str:
    """A claim of ``key`` whose effect a fenced commit marked, then completed if ``settle``."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from idempotency_mw import SQLStore
    from idempotency_mw.stores.sql import async_url

    assert isinstance(target.store, SQLStore)
    token = await claim(target.store, key)
    engine = create_async_engine(async_url(target.url))
    async with engine.begin() as conn:
        statement, params = target.store.fence_statement("", key, token, HOUR)
        assert (await conn.execute(statement, params)).rowcount == 1
    await engine.dispose()
    if settle:
        assert await target.store.complete("", key, token, RESPONSE, ttl=HOUR)
    return token


@pytest.mark.anyio
async def test_stats_and_inspect_count_fenced_commits(
    sql_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await fenced(sql_target, "paid", settle=True)
    await fenced(sql_target, "paying", settle=False)
    await completed(sql_target.store, "plain")
    code, shown = await sql_target.json(capsys, "stats")
    assert code == 0
    assert shown["fenced"] == 2
    assert shown["by_status"]["completed"] == 2
    code, out, _ = await sql_target.run(capsys, "stats")
    assert "of these, proved by fence()  2" in out
    code, shown = await sql_target.json(capsys, "inspect", "paid")
    assert (shown["status"], shown["fenced"]) == ("completed", True)
    code, shown = await sql_target.json(capsys, "inspect", "plain")
    assert shown["fenced"] is False


@pytest.mark.anyio
async def test_release_refuses_a_fenced_claim_unless_forced(
    sql_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    await fenced(sql_target, "paying", settle=False)
    code, out, err = await sql_target.run(capsys, "release", "paying")
    assert (code, out) == (1, "")
    assert "its effect was committed (a fenced commit)" in err
    retry = await sql_target.store.claim("", "paying", fingerprint("paying"), ttl=HOUR, lease=HOUR)
    assert retry.outcome is ClaimOutcome.IN_PROGRESS  # still held, not run again
    code, shown = await sql_target.json(capsys, "release", "paying", "--force")
    assert (code, shown["outcome"]) == (0, "released")


@pytest.mark.anyio
async def test_release_of_a_committed_record_says_its_effect_committed(
    sql_target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fenced claim released (its handler failed after the commit) is settled as committed.
    token = await fenced(sql_target, "paid", settle=False)
    await sql_target.store.release("", "paid", token)
    code, shown = await sql_target.json(capsys, "inspect", "paid")
    assert (shown["status"], shown["response_status"]) == ("committed", None)
    code, out, err = await sql_target.run(capsys, "release", "paid")
    assert (code, out) == (1, "")
    line = _one_line(err)
    assert "is committed, not in progress: its effect committed" in line
    assert "a release would let a retry run it again" in line
    assert "response is" not in line  # there is none to replay


# --- panel --------------------------------------------------------------------------------------


def test_the_panel_refuses_a_missing_store_or_journal_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo.db"
    assert main(["panel", "--store", f"sqlite:///{missing}"]) == 2
    assert _one_line(capsys.readouterr().err) == f"idempotency-mw: no SQLite database at {missing}"
    assert not missing.exists()
    journal = tmp_path / "typo.sqlite3"
    assert main(["panel", "--store", REDIS_URL, "--journal", str(journal)]) == 2
    assert _one_line(capsys.readouterr().err) == f"idempotency-mw: no journal file at {journal}"


def test_the_panel_without_jinja2_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert main(["migrate", "--url", url]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "jinja2", None)  # as if it were not installed
    assert main(["panel", "--store", url]) == 2
    assert _one_line(capsys.readouterr().err) == (
        "idempotency-mw: this needs jinja2: install the [panel] extra "
        "(pip install 'idempotency-mw[panel]', or from a checkout: pip install -e '.[panel]')"
    )
