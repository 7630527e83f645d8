"""The one rule by which SQLStore picks its driver (see :func:`open_driver`)."""

from __future__ import annotations

from typing import Literal

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from idempotency_mw._urls import shown_url
from idempotency_mw.exceptions import ConfigurationError, install_extra
from idempotency_mw.stores.sql.drivers.base import Driver
from idempotency_mw.stores.sql.drivers.engine import SQLAlchemyDriver, engine_for
from idempotency_mw.stores.sql.drivers.sqlite import Synchronous

#: ``"native"``: the store's own driver for the backend; ``"sqlalchemy"``: SQLAlchemy's engine.
DriverChoice = Literal["native", "sqlalchemy"]
#: The async driver used for each backend when a URL names none (or a sync one).
ASYNC_DRIVERS = {
    "sqlite": "aiosqlite",
    "postgresql": "asyncpg",
    "mysql": "asyncmy",
    "mariadb": "asyncmy",
}
_ASYNC_DRIVER_NAMES = {"aiosqlite", "asyncpg", "psycopg", "asyncmy", "aiomysql"}
#: The extra that installs each async driver the store uses by default.
_EXTRAS = {"aiosqlite": "sql", "asyncpg": "postgresql", "asyncmy": "mysql"}
_IN_MEMORY = (None, "", ":memory:")


def async_url(url: str | URL) -> URL:
    """``url`` with an async driver: ``sqlite:///x.db`` becomes ``sqlite+aiosqlite:///x.db``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {shown_url(url)!r}") from exc
    backend = parsed.get_backend_name()
    if backend not in ASYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() in _ASYNC_DRIVER_NAMES:
        return parsed
    return parsed.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")


def open_driver(
    database: str | URL | AsyncEngine,
    *,
    driver: DriverChoice | None = None,
    sqlite_wal: bool | None = None,
    sqlite_synchronous: Synchronous = "FULL",
) -> Driver:
    """The driver for ``database``, by one rule.

    An engine is used as it is, through SQLAlchemy. A URL gets the store's native driver
    where it has one, unless ``driver="sqlalchemy"``: a SQLite file the standard library's
    sqlite3 (in WAL unless ``sqlite_wal=False``), PostgreSQL asyncpg on a pool of the store's
    own, MariaDB/MySQL asyncmy's pool. Any other driver a URL names (psycopg, aiomysql) and an
    in-memory SQLite database go through SQLAlchemy's engine, as does everything with
    ``driver="sqlalchemy"``; ``driver="native"`` where there is none is refused.
    """
    if driver not in (None, "native", "sqlalchemy"):
        raise ConfigurationError("driver must be 'native' or 'sqlalchemy'")
    if sqlite_synchronous not in ("FULL", "NORMAL"):
        raise ConfigurationError("sqlite_synchronous must be 'FULL' or 'NORMAL'")
    if isinstance(database, AsyncEngine):
        if driver == "native":
            raise ConfigurationError("a given engine runs through SQLAlchemy: drop driver=")
        _sqlite_options_unused(sqlite_wal, sqlite_synchronous)
        return SQLAlchemyDriver(database, owned=False)
    url = async_url(database)
    backend, name = url.get_backend_name(), url.get_driver_name()
    native = _native_name(url)
    if driver == "native" and native is None:
        raise ConfigurationError(
            f"no native driver for {url.drivername}: use driver='sqlalchemy' or another URL"
        )
    use_native = native is not None and driver != "sqlalchemy"
    if backend != "sqlite" or not use_native:
        _sqlite_options_unused(sqlite_wal, sqlite_synchronous)
    try:
        if not use_native:
            return SQLAlchemyDriver(engine_for(url), owned=True, in_autocommit=True)
        if backend == "sqlite":
            if sqlite_synchronous == "NORMAL" and sqlite_wal is False:
                # Outside WAL, NORMAL can corrupt the file on a power cut.
                raise ConfigurationError("sqlite_synchronous='NORMAL' needs WAL (sqlite_wal=False)")
            from idempotency_mw.stores.sql.drivers.sqlite import SQLiteDriver

            return SQLiteDriver(url, wal=sqlite_wal is not False, synchronous=sqlite_synchronous)
        if backend == "postgresql":
            from idempotency_mw.stores.sql.drivers.postgresql import AsyncpgDriver

            return AsyncpgDriver(url)
        from idempotency_mw.stores.sql.drivers.mysql import AsyncmyDriver

        return AsyncmyDriver(url)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing != name:
            raise
        extra = _EXTRAS.get(name)
        how = install_extra(extra) if extra else f"pip install {name}"
        # Still a ModuleNotFoundError (which callers such as the CLI recognise), now saying
        # what to install.
        raise ModuleNotFoundError(f"SQLStore on {backend} needs {name}: {how}", name=name) from exc


def _native_name(url: URL) -> str | None:
    """The driver the URL names if the store has a native driver for it, else ``None``."""
    backend, name = url.get_backend_name(), url.get_driver_name()
    if backend == "sqlite":
        return name if url.database not in _IN_MEMORY else None
    return name if ASYNC_DRIVERS[backend] == name else None


def _sqlite_options_unused(wal: bool | None, synchronous: Synchronous) -> None:
    if wal or synchronous != "FULL":
        raise ConfigurationError(
            "sqlite_wal=True and sqlite_synchronous apply to a SQLite file URL only, "
            "on the native driver"
        )
