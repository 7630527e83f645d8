"""The ``idempotency-mw`` command: migrations, the purge, an operator's look at a store, the
settings of its server that lose records, the operator's web panel, and the Store contract's
conformance cases.

Parsing and printing only; the work is done by the stores (through
:mod:`idempotency_mw.operator.admin`), :mod:`idempotency_mw.operator.panel`, the purge and the
packaged Alembic revisions. Drivers are imported
only by the command that needs them, so a missing one is reported with the extra that installs
it. Every error is one line on stderr; exit codes: 0 done, 1 not done (the store failed, no
such record, a release refused, a conformance case failed, a setting found that can lose
records), 2 bad arguments, a missing driver or a missing table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from idempotency_mw._version import __version__
from idempotency_mw.engine.cleanup import DEFAULT_BATCH_SIZE
from idempotency_mw.operator.admin import DEFAULT_REDIS_PREFIX, relative_time
from idempotency_mw.values.exceptions import (
    ConfigurationError,
    SchemaError,
    StoreError,
    describe,
    install_extra,
)
from idempotency_mw.values.records import RecordStatus

if TYPE_CHECKING:
    from idempotency_mw.operator.admin import ReleaseResult
    from idempotency_mw.values.records import RecordView, StoreStats

T = TypeVar("T")

PROG = "idempotency-mw"
#: The extra of this package that installs each module a command may import.
EXTRA_OF_MODULE = {
    "asyncpg": "postgresql",
    "asyncmy": "mysql",
    "aiosqlite": "sql",
    "sqlalchemy": "sql",
    "alembic": "sql",
    "redis": "redis",
    "uvicorn": "panel",
    "jinja2": "panel",
    "httpx": "client",
    "pytest": "conformance",
}
DEFAULT_TIMEOUT = 30.0
#: The Redis prefix of the conformance cases' records: never the app's own.
CONFORMANCE_PREFIX = "idem-conformance:"


class _Failed(Exception):
    """A command that did not do its job: the message for stderr, and the exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- migrations ---------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    from alembic import command
    from alembic.util.exc import CommandError

    from idempotency_mw.operator.admin import is_redis_url
    from idempotency_mw.stores.sql.migrate import alembic_config

    if is_redis_url(args.store):
        print(f"{PROG}: Redis keeps no table: nothing to {args.command}")
        return 0
    config = alembic_config(args.store, proofs=args.proofs)
    try:
        if args.command == "migrate":
            command.upgrade(config, args.revision)
        else:
            command.downgrade(config, args.revision)
    except CommandError as exc:  # an unknown revision and the like
        raise _Failed(str(exc), 2) from exc
    print(f"{PROG}: {args.command} to {args.revision} done")
    return 0


# --- purge --------------------------------------------------------------------------------------


def _purge(args: argparse.Namespace) -> int:
    purged = _purged_proofs if args.proofs else _purged
    print(f"{PROG}: {_run(purged(args.store, args.batch_size, args.prefix), args.timeout)}")
    return 0


async def _purged_proofs(url: str, batch_size: int, prefix: str) -> str:
    from idempotency_mw.engine.cleanup import purge
    from idempotency_mw.operator.admin import open_proof_table

    async with open_proof_table(url) as table:
        report = await purge(table, batch_size=batch_size)
    return f"purged {report.deleted} expired fence() proofs in {report.seconds:.3f} s"


async def _purged(url: str, batch_size: int, prefix: str) -> str:
    from idempotency_mw.engine.cleanup import purge
    from idempotency_mw.operator.admin import open_store

    async with open_store(url, prefix=prefix) as store:
        report = await purge(store, batch_size=batch_size)
    if report.self_expiring:
        return "Redis expires records by itself (TTL): nothing to purge"
    return (
        f"purged {report.deleted} expired {'record' if report.deleted == 1 else 'records'} "
        f"in {report.seconds:.3f} s "
        f"({report.batches} {'batch' if report.batches == 1 else 'batches'} of at most "
        f"{batch_size})"
    )


# --- inspect, release, stats --------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from idempotency_mw.operator import admin

    lookup = _run(
        admin.inspect(
            args.store, args.key, scope=args.scope, with_body=args.body, prefix=args.prefix
        ),
        args.timeout,
    )
    record = lookup.record
    if args.json:
        _print_json(None if record is None else _record_json(record))
    if record is None:
        raise _Failed(
            f"no record of key {args.key!r} in scope {args.scope!r}"
            f"{_elsewhere(lookup.other_scopes)}"
        )
    if not args.json:
        _print_record(record)
        if record.body is not None:
            print()
            sys.stdout.write(record.body.decode("utf-8", "replace"))
    return 0


def _elsewhere(other_scopes: tuple[str, ...] | None) -> str:
    """Where else the key has records, as a hint for the operator."""
    if other_scopes is None:
        return " (Redis names records by a digest of scope and key: give the right --scope)"
    if not other_scopes:
        return ""
    scopes = ", ".join(repr(scope) for scope in other_scopes)
    return f"; the key has records in other scopes: {scopes} (give one with --scope)"


def _release(args: argparse.Namespace) -> int:
    from idempotency_mw.operator import admin
    from idempotency_mw.operator.admin import ReleaseOutcome

    result = _run(
        admin.release(args.store, args.key, scope=args.scope, force=args.force, prefix=args.prefix),
        args.timeout,
    )
    if args.json:
        _print_json(_release_json(result))
    described = f"key {args.key!r} in scope {args.scope!r}"
    match result.outcome:
        case ReleaseOutcome.RELEASED:
            assert result.record is not None
            if not args.json:
                print(
                    f"{PROG}: released {described} (it was {result.record.status}): "
                    "its next request runs again"
                )
            return 0
        case ReleaseOutcome.NOT_FOUND:
            raise _Failed(
                f"no record of {described}: nothing to release{_elsewhere(result.other_scopes)}"
            )
        case ReleaseOutcome.REFUSED:
            assert result.record is not None
            if result.record.in_progress:
                raise _Failed(
                    f"{described} is in progress, and its effect was committed (a fenced "
                    "commit): releasing it would run it again; --force deletes it anyway"
                )
            raise _Failed(
                f"{described} is {result.record.status}, not in progress: "
                f"{_SETTLED_MEANS[result.record.status]}; --force deletes it anyway (its next "
                "request then runs again)"
            )
        case ReleaseOutcome.CHANGED:
            raise _Failed(
                f"the record of {described} changed while it was being released "
                "(a request settled or took it): inspect it and try again"
            )


#: What a settled record means to a retry, said when a release of it is refused.
_SETTLED_MEANS = {
    RecordStatus.COMPLETED: "its response is what retries get",
    RecordStatus.UNREPLAYABLE: (
        "it ran, but its response was too large to record (retries get 409 not-replayable), "
        "and a release would let a retry run it again"
    ),
    RecordStatus.COMMITTED: (
        "its effect committed (a fenced commit, no response recorded), and a release would let "
        "a retry run it again"
    ),
}


def _stats(args: argparse.Namespace) -> int:
    from idempotency_mw.operator import admin

    stats = _run(admin.stats(args.store, prefix=args.prefix), args.timeout)
    if args.json:
        _print_json(_stats_json(stats))
    else:
        _print_stats(stats)
    return 0


# --- check --------------------------------------------------------------------------------------


def _check(args: argparse.Namespace) -> int:
    from idempotency_mw.operator import admin
    from idempotency_mw.stores.checks import can_lose_records

    found = _run(admin.check(args.store, prefix=args.prefix), args.timeout)
    for finding in found:
        print(finding)
    if can_lose_records(found):
        raise _Failed("found settings that can lose records (above): each line says its fix")
    print(f"{PROG}: nothing found that can lose records")
    return 0


# --- conformance --------------------------------------------------------------------------------


def _conformance(args: argparse.Namespace) -> int:
    import pytest

    from idempotency_mw.operator import conformance

    unknown = [case for case in args.case or () if case not in conformance.CASES]
    if unknown:
        raise _Failed(
            f"no such case: {', '.join(unknown)} (the cases: {' '.join(conformance.CASES)})", 2
        )
    # Opened once first: a missing table or an unreachable server is said once, not per case.
    _run(_opened(args.store, args.prefix), args.timeout)
    code = conformance.run(
        args.store,
        prefix=args.prefix,
        cases=args.case or conformance.CASES,
        tick=args.tick,
        case_timeout=args.timeout,
    )
    if code == pytest.ExitCode.TESTS_FAILED:
        raise _Failed("the store broke the contract: pytest's report above names each case")
    if code != 0:
        raise _Failed(f"pytest could not run the cases (its exit code: {code})", 2)
    return 0


async def _opened(url: str, prefix: str) -> None:
    from idempotency_mw.operator.admin import open_store

    async with open_store(url, prefix=prefix):
        pass


# --- the panel ----------------------------------------------------------------------------------


def _panel(args: argparse.Namespace) -> int:
    if args.journal is not None and "://" not in args.journal and not Path(args.journal).is_file():
        raise _Failed(f"no journal file at {args.journal}", 2)
    asyncio.run(_serve_panel(args))
    return 0


async def _serve_panel(args: argparse.Namespace) -> None:
    import uvicorn

    from idempotency_mw.operator.admin import open_store
    from idempotency_mw.operator.panel import panel

    async with AsyncExitStack() as stack:
        try:
            async with asyncio.timeout(DEFAULT_TIMEOUT):
                store = await stack.enter_async_context(open_store(args.store, prefix=args.prefix))
        except TimeoutError as exc:
            raise _Failed(f"the store did not answer within {DEFAULT_TIMEOUT:g} s") from exc
        journal = client = None
        if args.journal is not None:
            from idempotency_mw.client import IdempotentClient, open_journal

            journal = open_journal(args.journal)
            stack.callback(journal.close)
            client = IdempotentClient(journal=journal)
            stack.push_async_callback(client.aclose)
        # This command serves the panel from one process only: a secret of its own is every
        # worker's (a page of an earlier run is refused, as it should be).
        secret = secrets.token_bytes(32) if args.actions else None
        app = panel(
            store,
            journal=journal,
            client=client,
            actions=args.actions,
            secret=secret,
            limit=args.limit,
        )
        mode = "actions on, each confirmed on its page" if args.actions else "read-only"
        print(f"{PROG}: the panel is at http://127.0.0.1:{args.port}/ ({mode}); Ctrl-C stops it")
        config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
        await uvicorn.Server(config).serve()


# --- printing -----------------------------------------------------------------------------------


def _when(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    shown = f"{moment:%Y-%m-%d %H:%M:%S}.{moment.microsecond // 1000:03d} UTC"
    return f"{shown} ({relative_time(moment, now)})"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    scaled = float(size)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if scaled < 1024 or unit == "GiB":
            break
        scaled /= 1024
    return f"{size:,} bytes" if unit == "bytes" else f"{scaled:.1f} {unit}"


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label:<{width}}{value}")


def _print_record(record: RecordView) -> None:
    now = record.now
    response = "-"
    if record.response_status is not None:
        response = f"{record.response_status}, {_size(record.response_size)}"
    rows = [
        ("key", f"{record.key!r} in scope {record.scope!r}"),
        ("status", _status(record)),
        ("request hash", record.request_hash),
        ("created", _when(record.created_at, now)),
        ("lease until", _when(record.lease_expires_at, now)),
        ("expires", _when(record.expires_at, now)),
        ("response", response),
        ("store clock", _when(now, now).split(" (")[0]),
    ]
    _print_rows(rows)


def _status(record: RecordView) -> str:
    shown = str(record.status)
    if record.fenced:
        shown += ", effect committed (fenced)"
    if record.expired:
        shown += " (expired: treated as absent)"
    elif record.stuck:
        shown += " (its lease lapsed: stuck until a retry takes it or it is released)"
    return shown


def _print_stats(stats: StoreStats) -> None:
    rows = [("records", f"{stats.total:,}")]
    rows += [(f"  {status}", f"{count:,}") for status, count in stats.by_status.items()]
    fenced = "- (no fenced commits in this store)" if stats.fenced is None else f"{stats.fenced:,}"
    rows.append(("of these, proved by fence()", fenced))  # as the panel says it
    expired = "- (Redis deletes them itself)" if stats.expired is None else f"{stats.expired:,}"
    rows += [
        ("expired, awaiting purge", expired),
        ("oldest in progress", _when(stats.oldest_in_progress, stats.now)),
        ("size", _size(stats.size_bytes)),
        ("store clock", _when(stats.now, stats.now).split(" (")[0]),
    ]
    _print_rows(rows)


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds")


def _record_json(record: RecordView) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "scope": record.scope,
        "key": record.key,
        "status": record.status.value,
        "fenced": record.fenced,
        "expired": record.expired,
        "request_hash": record.request_hash,
        "created_at": _iso(record.created_at),
        "lease_expires_at": _iso(record.lease_expires_at),
        "expires_at": _iso(record.expires_at),
        "response_status": record.response_status,
        "response_size": record.response_size,
        "now": _iso(record.now),
    }
    if record.body is not None:
        shown["body_base64"] = base64.b64encode(record.body).decode()
    return shown


def _release_json(result: ReleaseResult) -> dict[str, Any]:
    record = None if result.record is None else _record_json(result.record)
    return {"outcome": result.outcome.value, "record": record}


def _stats_json(stats: StoreStats) -> dict[str, Any]:
    return {
        "total": stats.total,
        "by_status": {status.value: count for status, count in stats.by_status.items()},
        "fenced": stats.fenced,
        "expired": stats.expired,
        "oldest_in_progress": _iso(stats.oldest_in_progress),
        "size_bytes": stats.size_bytes,
        "now": _iso(stats.now),
    }


def _print_json(value: Any) -> None:
    print(json.dumps(value))


# --- running ------------------------------------------------------------------------------------


def _run(operation: Awaitable[T], timeout: float) -> T:
    """Run a store operation to its end, or fail after ``timeout`` seconds."""

    async def bounded() -> T:
        try:
            async with asyncio.timeout(timeout):
                return await operation
        except TimeoutError as exc:
            raise _Failed(f"the store did not answer within {timeout:g} s") from exc

    return asyncio.run(bounded())


# --- the caller's journal ------------------------------------------------------------------------


def _journal_attention(args: argparse.Namespace) -> int:
    from idempotency_mw.client.attention import attention_rows, format_rows
    from idempotency_mw.client.journals import open_journal

    where: str = args.journal
    if "://" not in where and not Path(where).is_file():
        raise _Failed(f"no journal file at {where}", 2)
    journal = open_journal(where)
    try:
        rows = attention_rows(journal)
    finally:
        journal.close()
    print(format_rows(rows) if rows else f"{PROG}: no operation needs attention")
    return 0


def _one_line(exc: BaseException) -> tuple[str, int]:
    """An error as the shell sees it: one line, and the exit code."""
    if isinstance(exc, _Failed):
        return str(exc), exc.exit_code
    if isinstance(exc, ModuleNotFoundError):
        module = (exc.name or "").partition(".")[0]
        extra = EXTRA_OF_MODULE.get(module)
        if extra is None:
            return describe(exc), 2
        return f"this needs {module}: {install_extra(extra)}", 2
    if isinstance(exc, ConfigurationError | SchemaError):
        return str(exc), 2
    cause = exc.__cause__ if isinstance(exc, StoreError) and exc.__cause__ else exc
    return describe(cause), 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Manage the idempotency-mw table and look into a store."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Callable[[argparse.Namespace], int], summary: str) -> Any:
        sub = commands.add_parser(name, help=summary, description=summary)
        sub.set_defaults(run=run)
        return sub

    def prefix_option(sub: Any) -> None:
        sub.add_argument(
            "--prefix",
            default=DEFAULT_REDIS_PREFIX,
            help=f"Redis key prefix of the store (default: {DEFAULT_REDIS_PREFIX})",
        )

    def store_option(sub: Any, what: str = "database or redis:// URL of the store") -> None:
        # One name on every command; --url, which some commands took first, stays an alias.
        sub.add_argument("--store", "--url", dest="store", metavar="URL", required=True, help=what)

    def store_options(sub: Any, *, keyed: bool) -> None:
        store_option(sub)
        if keyed:
            sub.add_argument("key", help="the Idempotency-Key, as the client sent it")
            sub.add_argument("--scope", default="", help="the caller scope (default: none)")
        prefix_option(sub)
        sub.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            help=f"seconds to wait for the store (default: {DEFAULT_TIMEOUT:g})",
        )
        sub.add_argument("--json", action="store_true", help="print JSON, for scripts")

    migrate = command("migrate", _migrate, "create or upgrade the table (alembic upgrade)")
    store_option(migrate, "database URL, e.g. sqlite:///./app.db")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    downgrade = command("downgrade", _migrate, "downgrade the table (base removes it)")
    store_option(downgrade, "database URL")
    downgrade.add_argument("--revision", default="base", help="target revision (default: base)")
    for sub in (migrate, downgrade):
        sub.add_argument(
            "--proofs",
            action="store_true",
            help="the fence() proof table, in the app's database (a store elsewhere)",
        )

    purge = command("purge", _purge, "delete expired records now")
    store_option(purge)
    prefix_option(purge)
    purge.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="rows per transaction"
    )
    purge.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds the purge may take in all"
    )
    purge.add_argument(
        "--proofs", action="store_true", help="the fence() proof table of this database URL"
    )

    inspect = command("inspect", _inspect, "show one key's record (never its body unless --body)")
    store_options(inspect, keyed=True)
    inspect.add_argument("--body", action="store_true", help="print the recorded response body")
    release = command(
        "release",
        _release,
        "free a key stuck in progress, so that its next request runs again",
    )
    store_options(release, keyed=True)
    release.add_argument(
        "--force", action="store_true", help="delete a completed record too (no more replays)"
    )
    stats = command(
        "stats", _stats, "count records by status, fenced and expired ones, the table's size"
    )
    store_options(stats, keyed=False)

    checked = command(
        "check",
        _check,
        "find the settings of the store's server (and the clock) that can lose records: one "
        "line each, with its fix; exits 1 if any can",
    )
    checked.add_argument(
        "--store", "--url", dest="store", required=True, help="database or redis:// URL"
    )
    prefix_option(checked)
    checked.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for the store (default: {DEFAULT_TIMEOUT:g})",
    )

    conformance = command(
        "conformance",
        _conformance,
        "run the Store contract's cases on a store: each in a scope of its own, its records "
        "deleted after it; exits 1 if any case fails",
    )
    store_option(conformance)
    conformance.add_argument(
        "--prefix",
        default=CONFORMANCE_PREFIX,
        help=f"Redis key prefix of the cases' records (default: {CONFORMANCE_PREFIX})",
    )
    conformance.add_argument(
        "--case",
        action="append",
        metavar="NAME",
        help="run only this case (repeatable; default: all)",
    )
    conformance.add_argument(
        "--tick",
        type=float,
        default=0.1,
        help="the shortest lease and TTL the cases give, in seconds (default: 0.1)",
    )
    conformance.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds each case may take (default: {DEFAULT_TIMEOUT:g})",
    )

    served = command(
        "panel",
        _panel,
        "serve the operator's web panel on 127.0.0.1 (read-only unless --actions)",
    )
    store_option(served)
    prefix_option(served)
    served.add_argument(
        "--journal", help="a client's journal: SQLite path, database URL or redis:// URL"
    )
    served.add_argument(
        "--actions",
        action="store_true",
        help="offer the actions (release, retry, mark), each confirmed on its own page",
    )
    served.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default: 8765)")
    served.add_argument("--limit", type=int, default=50, help="records per list (default: 50)")

    journal = commands.add_parser("journal", help="look into a client's journal")
    actions = journal.add_subparsers(dest="action", required=True)
    attention = actions.add_parser(
        "attention", help="list operations that need a person (confirmation or intervention)"
    )
    attention.set_defaults(run=_journal_attention)
    attention.add_argument(
        "--journal", required=True, help="SQLite journal path, database URL or redis:// URL"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idempotency-mw`` command."""
    args = _parser().parse_args(argv)
    try:
        exit_code: int = args.run(args)
    except Exception as exc:
        message, exit_code = _one_line(exc)
        print(f"{PROG}: {message}", file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
