"""What SQLStore needs from a driver, and the statements every driver runs compiled once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import Connection
from sqlalchemy.engine import URL, Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.replies import ReplyWait

T = TypeVar("T")
Rows = Sequence[Sequence[Any]]


class Driver(Protocol):
    """How SQLStore's statements reach its database.

    Every statement runs on its own, in autocommit. ``deadline`` (on ``time.monotonic()``) is
    when the store stops waiting for the call: a statement that could not start by then (a
    lock it waits for in a thread, a re-run) never starts later. A write with
    ``durable=False`` may be answered before its commit reached the disk, where the database
    allows that per connection (PostgreSQL through asyncpg, SQLite in WAL); elsewhere every
    commit waits for the disk.
    """

    dialect_name: str
    #: Whether the database is a file on its callers' own machine (SQLite): a crash that loses
    #: its latest commits also ends every process that could have acted on them.
    on_callers_machine: bool
    #: Where the driver connects (shown, without its password, in errors).
    url: URL
    #: Exceptions that mean "the database failed" (wrapped into StoreError by the store).
    errors: tuple[type[Exception], ...]

    async def fetch(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> Rows:
        """Rows of one statement."""
        ...

    async def change(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> int:
        """Rows changed by one statement."""
        ...

    async def run_sync(self, operation: Callable[[Connection], T], *, deadline: float) -> T:
        """``operation`` on a SQLAlchemy connection (the start-up check)."""
        ...

    async def aclose(self) -> None:
        """Close what the driver opened; it opens again if it is used again."""
        ...


class Compiled:
    """A statement compiled once for a dialect, with its parameters in the driver's order.

    Built on SQLAlchemy's public compiler API (``compile``, ``positiontup``, ``params``), for
    the drivers that hand SQL straight to a DBAPI-level connection.
    """

    def __init__(self, statement: Executable, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, cast(ClauseElement, statement).compile(dialect=dialect))
        self.sql = compiled.string
        #: Whether the statement changes rows (so commits, and waits for the disk).
        self.writes = bool(getattr(statement, "is_dml", False))
        #: How long this statement's replies take, to keep the loop awake for the fast ones.
        self.replies = ReplyWait()
        self._names = tuple(compiled.positiontup or ())
        self._defaults = compiled.params

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        """The statement's arguments in order: from ``params``, else the statement's own."""
        return tuple(map({**self._defaults, **params}.__getitem__, self._names))


class CompileCache:
    """Each statement compiled once for one dialect."""

    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._compiled: dict[int, tuple[Executable, Compiled]] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def __call__(self, statement: Executable) -> Compiled:
        # Keyed by identity: the store's statements are module-level and live forever; the
        # statement is kept in the entry so its id is never reused by another object.
        entry = self._compiled.get(id(statement))
        if entry is None:
            entry = (statement, Compiled(statement, self._dialect))
            self._compiled[id(statement)] = entry
        return entry[1]
