"""SQLStore's look at its database's settings, as the store's own connections see them (a
URL's settings and ``ALTER DATABASE``/``ALTER ROLE`` ones included): durability of commits, the
timeouts that can cut a claim or completion short, and the server's clock."""

from __future__ import annotations

from sqlalchemy import select, text

from idempotency_mw.stores.sql.database import Database
from idempotency_mw.stores.sql.statements import NOW
from idempotency_mw.values.findings import Finding, ServerCheck

#: Each dialect's settings, as ``(name, value)`` rows.
_SETTINGS = {
    "postgresql": text(
        "SELECT name, setting FROM pg_settings WHERE name IN ('synchronous_commit', 'fsync', "
        "'statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')"
    ),
    "mysql": text(
        "SHOW VARIABLES WHERE Variable_name IN ('innodb_flush_log_at_trx_commit', "
        "'max_statement_time', 'innodb_lock_wait_timeout')"
    ),
    "sqlite": text("SELECT 'synchronous', synchronous FROM pragma_synchronous"),
}
_SETTINGS["mariadb"] = _SETTINGS["mysql"]
#: The timeouts that end a statement (or its session) early, and their unit in seconds.
_TIMEOUTS = {
    "statement_timeout": 0.001,
    "lock_timeout": 0.001,
    "idle_in_transaction_session_timeout": 0.001,
    "max_statement_time": 1.0,
    "innodb_lock_wait_timeout": 1.0,
}
#: Each setting that makes a commit answer before it is on disk: the values that do.
_UNFLUSHED = {
    "synchronous_commit": {"off"},
    "fsync": {"off"},
    "innodb_flush_log_at_trx_commit": {"0", "2"},
    "synchronous": {"0", "1"},  # SQLite: OFF, NORMAL
}
_FIXES = {
    "synchronous_commit": "synchronous_commit = on (fenced=True routes skip the flush by "
    "themselves, safely)",
    "fsync": "fsync = on",
    "innodb_flush_log_at_trx_commit": "innodb_flush_log_at_trx_commit = 1",
    "synchronous": 'sqlite_synchronous="FULL" (the default)',
}


async def server_check(
    database: Database, operation_timeout: float, deadline: float
) -> ServerCheck:
    """The findings about ``database``'s settings against the store's ``operation_timeout``."""
    dialect = database.dialect_name
    rows = await database.fetch(_SETTINGS[dialect], {}, deadline=deadline)
    findings = [
        finding
        for name, value in rows
        if (finding := _finding(str(name), str(value), operation_timeout)) is not None
    ]
    now = None
    if dialect != "sqlite":  # SQLite's clock is the app's machine's own
        ((now_ms,),) = await database.fetch(select(NOW), {}, deadline=deadline)
        now = now_ms / 1000
    return ServerCheck(tuple(findings), now=now)


def _finding(name: str, value: str, operation_timeout: float) -> Finding | None:
    if name in _UNFLUSHED:
        if value.lower() not in _UNFLUSHED[name]:
            return None
        return Finding(
            name,
            value,
            "a crash loses the latest records (and fence() proofs), though their requests "
            "were answered: their keys run again",
            _FIXES[name],
        )
    seconds = float(value) * _TIMEOUTS[name]
    if not 0 < seconds < operation_timeout:
        return None
    return Finding(
        name,
        f"{seconds:g} s",
        "a claim or completion that waits longer (a lock, a busy server) is cut short: its "
        "record stays in progress, and once its lease lapses a retry runs the request again",
        f"{name} = 0 for the store's connections, or longer than the store's operation "
        f"timeout ({operation_timeout:g} s)",
    )
