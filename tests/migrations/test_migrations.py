"""The Alembic migrations, the ``idempotency-mw`` command and the packaged revisions.

Tests that migrate a server database do it in a database of their own (``fresh_database`` in
conftest.py), never in the shared one the other tests use.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Connection, create_engine, inspect, make_url, text
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.engine.proofs import proof_metadata
from idempotency_mw.operator.cli import main
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.migrate import alembic_config, upgrade
from idempotency_mw.stores.sql.schema import SCHEMA_REVISION, TABLE_NAME, metadata, records
from tests.conftest import POSTGRESQL_URL, require_server
from tests.support import warm
from tests.support.scratch import scratch_database

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The version table of the packaged env.py (kept apart from an application's ``alembic_version``).
VERSION_TABLE = "idempotency_mw_alembic_version"
INDEX_NAME = "ix_idempotency_records_expires_at"
SUBPROCESS_TIMEOUT = 180


def _alembic_executable() -> str:
    # The console script next to the running interpreter: .venv/bin/alembic in this repository.
    candidate = Path(sys.executable).parent / "alembic"
    found = str(candidate) if candidate.exists() else shutil.which("alembic")
    assert found, "the alembic command is not installed next to the test interpreter"
    return found


def _run(
    args: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command as a user would; fail with its output when it does not succeed."""
    base = {
        k: v for k, v in os.environ.items() if k not in ("IDEMPOTENCY_DATABASE_URL", "PYTHONPATH")
    }
    env = {**base, **(env or {})}
    if warm.is_warm(args[0]):
        result = warm.run(args, cwd=cwd, env=env, timeout=SUBPROCESS_TIMEOUT)
    else:
        result = subprocess.run(
            args,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT,
            check=False,
        )
    assert result.returncode == 0, (
        f"{args} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def _alembic(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    """``alembic <args>`` from the repository root, with IDEMPOTENCY_DATABASE_URL=url."""
    return _run(
        [_alembic_executable(), *args], cwd=REPO_ROOT, env={"IDEMPOTENCY_DATABASE_URL": url}
    )


def _on_connection(url: str, operation: Callable[[Connection], T]) -> T:
    """Run ``operation`` on a sync view of an async connection to ``url``, in one transaction."""

    async def go() -> T:
        engine = create_async_engine(async_url(url))
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(operation)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _include_own_tables(name: str | None, type_: str, parent_names: Any) -> bool:
    # The version table (and any table a user project adds) is no part of the model: compare
    # only the tables the model declares, and everything inside them.
    return type_ != "table" or name in metadata.tables


def _schema_differences(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(
        conn,
        opts={
            "compare_type": True,
            "include_name": _include_own_tables,
            "version_table": VERSION_TABLE,
        },
    )
    # No filtering of type differences is needed: the migration uses the model's types,
    # variants included, and the comparison reports none on SQLite, PostgreSQL or MariaDB.
    return list(compare_metadata(context, metadata))


@dataclass
class Snapshot:
    tables: set[str]
    columns: dict[str, dict[str, Any]]
    primary_key: dict[str, Any]
    indexes: dict[str, dict[str, Any]]
    versions: list[str]
    differences: list[Any]


def _snapshot(conn: Connection) -> Snapshot:
    inspector = inspect(conn)
    tables = set(inspector.get_table_names())
    versions: list[str] = []
    if VERSION_TABLE in tables:
        versions = list(conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
    if TABLE_NAME not in tables:
        return Snapshot(tables, {}, {}, {}, versions, [])
    return Snapshot(
        tables=tables,
        columns={column["name"]: dict(column) for column in inspector.get_columns(TABLE_NAME)},
        primary_key=dict(inspector.get_pk_constraint(TABLE_NAME)),
        indexes={str(index["name"]): dict(index) for index in inspector.get_indexes(TABLE_NAME)},
        versions=versions,
        differences=_schema_differences(conn),
    )


def _assert_matches_model(snapshot: Snapshot, dialect: str) -> None:
    assert TABLE_NAME in snapshot.tables
    assert set(snapshot.columns) == set(records.c.keys())
    for column in records.c:
        assert snapshot.columns[column.name]["nullable"] == column.nullable, column.name
    assert snapshot.primary_key["constrained_columns"] == ["scope", "key"]
    if dialect == "postgresql":  # the only backend here that keeps the constraint's name
        assert snapshot.primary_key["name"] == "pk_idempotency_records"
    assert INDEX_NAME in snapshot.indexes, snapshot.indexes
    assert snapshot.indexes[INDEX_NAME]["column_names"] == ["expires_at"]
    assert not snapshot.indexes[INDEX_NAME]["unique"]
    assert snapshot.differences == []
    if dialect in ("mysql", "mariadb"):
        # Autogenerate does not compare collations: check the case-sensitive keys explicitly,
        # and the LONGBLOBs (a BLOB would cap responses at 64 KiB).
        for name in ("scope", "key"):
            assert snapshot.columns[name]["type"].collation == "utf8mb4_bin", name
        for name in ("response_headers", "result_payload"):
            assert isinstance(snapshot.columns[name]["type"], mysql.LONGBLOB), name


def _dialect(url: str) -> str:
    return make_url(url).get_backend_name()


# --- alembic, from the repository root ------------------------------------------------------


@pytest.mark.parametrize("url_form", ["plain", "async"])
def test_alembic_upgrade_and_downgrade_from_repository_root(
    fresh_database: str, url_form: str
) -> None:
    url = fresh_database
    if url_form == "async":  # e.g. sqlite+aiosqlite:///..., postgresql+asyncpg://...
        url = async_url(url).render_as_string(hide_password=False)
        assert "+" in make_url(url).drivername
    assert _on_connection(url, _snapshot).tables == set()

    _alembic("upgrade", "head", url=url)

    after = _on_connection(url, _snapshot)
    _assert_matches_model(after, _dialect(url))
    # The history lives in its own version table, never in the application's alembic_version.
    assert after.tables == {TABLE_NAME, VERSION_TABLE}
    assert after.versions == [SCHEMA_REVISION]
    current = _alembic("current", url=url)
    assert f"{SCHEMA_REVISION} (head)" in current.stdout

    _alembic("upgrade", "head", url=url)  # already at head: nothing to do, no error
    assert _on_connection(url, _snapshot).versions == [SCHEMA_REVISION]

    _alembic("downgrade", "base", url=url)

    downgraded = _on_connection(url, _snapshot)
    assert TABLE_NAME not in downgraded.tables
    assert downgraded.versions == []


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///unused.db", ['"key" VARCHAR(255) NOT NULL', "response_headers BLOB"]),
        ("postgresql://postgres@127.0.0.1:1/test", ["key VARCHAR(255)", "response_headers BYTEA"]),
        (
            "mysql://root@127.0.0.1:1/test",
            ["`key` VARCHAR(255) COLLATE utf8mb4_bin NOT NULL", "response_headers LONGBLOB"],
        ),
    ],
)
def test_alembic_offline_mode_renders_the_ddl(url: str, expected: list[str]) -> None:
    """``alembic upgrade head --sql`` prints the DDL of each dialect without connecting."""
    result = _alembic("upgrade", "head", "--sql", url=url)
    sql = result.stdout
    assert "CREATE TABLE idempotency_records" in sql
    assert f"CREATE INDEX {INDEX_NAME} ON idempotency_records (expires_at)" in sql
    assert f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('{SCHEMA_REVISION}')" in sql
    assert "caller_binding VARCHAR(64) NOT NULL" in sql
    for fragment in expected:
        assert fragment in sql
    assert not (REPO_ROOT / "unused.db").exists()


def test_schema_revision_is_the_head_of_the_packaged_migrations() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert script.get_heads() == [SCHEMA_REVISION]
    head = script.get_revision("idempotency_mw@head")
    assert head is not None
    assert head.revision == SCHEMA_REVISION


def test_alembic_config_keeps_percent_signs_and_selects_an_async_driver() -> None:
    url = URL.create(
        "postgresql", username="app", password="100%sure", host="db.example", database="app"
    )
    config = alembic_config(url.render_as_string(hide_password=False))
    configured = make_url(config.get_main_option("sqlalchemy.url") or "")
    assert configured.drivername == "postgresql+asyncpg"
    assert configured.password == "100%sure"
    assert configured.host == "db.example"


# --- the idempotency-mw command ---------------------------------------------------------------


def test_cli_migrate_and_downgrade(fresh_database: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = fresh_database

    assert main(["migrate", "--url", url]) == 0
    assert "migrate to head done" in capsys.readouterr().out
    migrated = _on_connection(url, _snapshot)
    _assert_matches_model(migrated, _dialect(url))
    assert migrated.versions == [SCHEMA_REVISION]

    assert main(["migrate", "--url", url]) == 0  # idempotent
    assert _on_connection(url, _snapshot).versions == [SCHEMA_REVISION]

    assert main(["downgrade", "--url", url]) == 0
    assert "downgrade to base done" in capsys.readouterr().out
    downgraded = _on_connection(url, _snapshot)
    assert TABLE_NAME not in downgraded.tables
    assert downgraded.versions == []


def test_the_stores_url_with_driver_options_migrates_and_purges(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One URL for the store and its commands: the options asyncpg's ``connect()`` does not
    take itself (``application_name``, libpq's ``sslmode``) reach PostgreSQL as SQLStore passes
    them, for ``migrate`` and ``purge --proofs`` too, never as an argument asyncpg refuses."""
    require_server(POSTGRESQL_URL)
    with scratch_database(POSTGRESQL_URL, "options") as database:
        url = f"{database}?application_name=idempotency-migrate&sslmode=prefer"
        for command in (["migrate"], ["migrate", "--proofs"], ["purge", "--proofs"]):
            assert main([*command, "--url", url]) == 0, capsys.readouterr().err
        assert main(["stats", "--url", url]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_cli_migrates_the_proof_table_on_its_own_branch(
    fresh_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``migrate --proofs`` makes the proof table as its model says, beside (never inside) the
    idempotency table's own history, and ``downgrade --proofs`` removes it alone."""
    from idempotency_mw.alembic import PROOF_VERSION_TABLE
    from idempotency_mw.engine.proofs import PROOF_TABLE, proof_metadata

    url = fresh_database

    def proof_differences(conn: Connection) -> tuple[set[str], list[str], list[Any]]:
        tables = set(inspect(conn).get_table_names())
        versions = []
        if PROOF_VERSION_TABLE in tables:
            versions = list(
                conn.execute(text(f"SELECT version_num FROM {PROOF_VERSION_TABLE}")).scalars()
            )
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_name": lambda name, type_, _: type_ != "table" or name == PROOF_TABLE,
            },
        )
        return tables, versions, list(compare_metadata(context, proof_metadata))

    assert main(["migrate", "--url", url]) == 0
    assert main(["migrate", "--proofs", "--url", url]) == 0
    assert main(["migrate", "--proofs", "--url", url]) == 0  # idempotent
    tables, versions, differences = _on_connection(url, proof_differences)
    assert {PROOF_TABLE, TABLE_NAME} <= tables
    assert versions == ["0001_idempotency_proofs"]
    assert differences == []
    assert _on_connection(url, _snapshot).versions == [SCHEMA_REVISION]
    assert main(["downgrade", "--proofs", "--url", url]) == 0
    tables, versions, _ = _on_connection(url, proof_differences)
    assert PROOF_TABLE not in tables
    assert TABLE_NAME in tables
    assert versions == []
    capsys.readouterr()


def test_workers_migrating_a_fresh_database_at_once_all_succeed(fresh_database: str) -> None:
    """Four processes started together (uvicorn workers, each migrating in its lifespan) take
    the migration lock in turn: one creates the table, the others find it recorded."""
    code = "import sys; from idempotency_mw.stores.sql.migrate import upgrade_sync; "
    code += "upgrade_sync(sys.argv[1])"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", code, fresh_database],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        for _ in range(4)
    ]
    errors = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * 4, errors
    assert _on_connection(fresh_database, _snapshot).versions == [SCHEMA_REVISION]


def test_cli_migrate_to_an_explicit_revision(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert main(["migrate", "--url", url, "--revision", SCHEMA_REVISION]) == 0
    assert _on_connection(url, _snapshot).versions == [SCHEMA_REVISION]
    assert main(["downgrade", "--url", url, "--revision", "base"]) == 0
    assert TABLE_NAME not in _on_connection(url, _snapshot).tables


@pytest.mark.anyio
async def test_upgrade_from_a_running_event_loop(tmp_path: Path) -> None:
    """``upgrade()`` runs the migrations (and env.py's own event loop) in a worker thread."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    await upgrade(url)
    engine = create_async_engine(async_url(url))
    try:
        async with engine.connect() as conn:
            snapshot = await conn.run_sync(_snapshot)
    finally:
        await engine.dispose()
    _assert_matches_model(snapshot, "sqlite")
    assert snapshot.versions == [SCHEMA_REVISION]


def _assert_one_line_error(err: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("idempotency-mw: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("url", ["nonsense", "oracle://x/y"])
@pytest.mark.parametrize("command", ["migrate", "downgrade"])
def test_cli_rejects_a_bad_url(command: str, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--url", url]) == 2
    captured = capsys.readouterr()
    _assert_one_line_error(captured.err)
    assert captured.out == ""


def test_cli_rejects_an_unknown_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert main(["migrate", "--url", url, "--revision", "no_such_revision"]) == 2
    err = capsys.readouterr().err
    _assert_one_line_error(err)
    assert "no_such_revision" in err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://postgres@127.0.0.1:1/test",
        "mysql://root@127.0.0.1:1/test",
    ],
)
def test_cli_reports_an_unreachable_database_in_one_line(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--url", url]) == 1
    _assert_one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("proofs", [False, True], ids=["records", "proofs"])
def test_cli_over_a_create_all_table_names_the_way_out(
    fresh_database: str, capsys: pytest.CaptureFixture[str], proofs: bool
) -> None:
    """A table made by ``create_all`` (no migration history) makes CREATE TABLE fail: one line
    that names the way out, on every database (PostgreSQL's aborted transaction included)."""
    made = proof_metadata if proofs else metadata
    _on_connection(fresh_database, made.create_all)
    assert main(["migrate", *(["--proofs"] if proofs else []), "--url", fresh_database]) == 2
    err = capsys.readouterr().err
    _assert_one_line_error(err)
    assert "alembic stamp idempotency_mw@head" in err
    # The table of a project of the user's own that includes our revisions is upgraded there.
    assert "recipe B), upgrade there: `alembic upgrade heads`" in err


# --- an application's own Alembic project -----------------------------------------------------

_USER_ENV = """\
import os

from alembic import context
from sqlalchemy import create_engine

engine = create_engine(os.environ["APP_DATABASE_URL"])
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

_USER_REVISION = """\
import sqlalchemy as sa
from alembic import op

revision = "a1_users"
down_revision = None
branch_labels = ("app",)
depends_on = None


def upgrade():
    op.create_table("users", sa.Column("id", sa.Integer, primary_key=True))


def downgrade():
    op.drop_table("users")
"""


def _user_project(root: Path, path_separator: str | None) -> Path:
    (root / "migrations").mkdir(parents=True)
    (root / "versions").mkdir()
    (root / "migrations" / "env.py").write_text(_USER_ENV)
    (root / "versions" / "a1_users.py").write_text(_USER_REVISION)
    separator = f"path_separator = {path_separator}\n" if path_separator else ""
    (root / "alembic.ini").write_text(
        textwrap.dedent(
            """\
            [alembic]
            script_location = %(here)s/migrations
            version_locations = %(here)s/versions idempotency_mw:migrations/versions
            """
        )
        + separator
    )
    return root


def _sqlite_tables_and_versions(path: Path) -> tuple[set[str], set[str], list[Any]]:
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
            versions = set(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
            differences = _schema_differences(conn) if TABLE_NAME in tables else []
    finally:
        engine.dispose()
    return tables, versions, differences


@dataclass
class Installation:
    """Where ``idempotency_mw`` is imported from in a subprocess."""

    env: dict[str, str]
    package_dir: Path


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO_ROOT),
        ],
        cwd=out,
    )
    (wheel,) = out.glob("idempotency_mw-*.whl")
    return wheel


@pytest.fixture
def installation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Installation:
    """The package as installed in the venv, or as unpacked from the built wheel."""
    if request.param == "development":
        return Installation(env={}, package_dir=REPO_ROOT / "idempotency_mw")
    wheel: Path = request.getfixturevalue("built_wheel")
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return Installation(env={"PYTHONPATH": str(site)}, package_dir=site / "idempotency_mw")


def _imported_package_dir(installation: Installation, cwd: Path) -> Path:
    result = _run(
        [sys.executable, "-c", "import idempotency_mw; print(idempotency_mw.__file__)"],
        cwd=cwd,
        env=installation.env,
    )
    return Path(result.stdout.strip()).resolve().parent


@pytest.mark.parametrize(
    ("installation", "path_separator"),
    [
        ("development", "space"),
        # No path_separator: Alembic's legacy splitting on spaces (it warns, but works). Note
        # that "path_separator = os", which `alembic init` writes, splits on ":" on POSIX and
        # so cannot name a package resource like idempotency_mw:migrations/versions.
        ("development", None),
        ("wheel", "space"),
    ],
    indirect=["installation"],
)
def test_application_alembic_project_includes_the_packaged_revisions(
    tmp_path: Path, installation: Installation, path_separator: str | None
) -> None:
    project = _user_project(tmp_path / "project", path_separator)
    # The project directory holds no copy of the package: it must come from the installation.
    assert _imported_package_dir(installation, project) == installation.package_dir.resolve()
    alembic = _alembic_executable()

    def run(*args: str, database: Path) -> subprocess.CompletedProcess[str]:
        env = {**installation.env, "APP_DATABASE_URL": f"sqlite:///{database}"}
        return _run([alembic, "-c", str(project / "alembic.ini"), *args], cwd=project, env=env)

    both = tmp_path / "both.db"
    heads = run("heads", database=both).stdout.splitlines()
    assert f"{SCHEMA_REVISION} (idempotency_mw) (head)" in heads
    assert "a1_users (app) (head)" in heads

    run("upgrade", "heads", database=both)
    tables, versions, differences = _sqlite_tables_and_versions(both)
    assert {"users", TABLE_NAME, "alembic_version"} <= tables
    assert VERSION_TABLE not in tables  # the application's env.py keeps one history table
    assert versions == {"a1_users", SCHEMA_REVISION}
    assert differences == []  # the packaged revision under a sync engine matches the model

    only_ours = tmp_path / "only_ours.db"
    run("upgrade", "idempotency_mw@head", database=only_ours)
    tables, versions, differences = _sqlite_tables_and_versions(only_ours)
    assert TABLE_NAME in tables
    assert "users" not in tables
    assert versions == {SCHEMA_REVISION}
    assert differences == []

    run("downgrade", "idempotency_mw@base", database=only_ours)
    tables, versions, _ = _sqlite_tables_and_versions(only_ours)
    assert TABLE_NAME not in tables
    assert versions == set()


# --- the wheel ----------------------------------------------------------------------------------


def test_wheel_ships_the_migrations_the_lua_scripts_and_the_templates(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as archive:
        names = set(archive.namelist())
    assert "idempotency_mw/migrations/env.py" in names
    assert "idempotency_mw/migrations/versions/0001_idempotency_records.py" in names
    assert "idempotency_mw/stores/sql/schema.py" in names
    scripts = ("prelude", "claim", "renew", "complete", "release")
    assert {f"idempotency_mw/stores/redis/lua/{name}.lua" for name in scripts} <= names
    templates = (REPO_ROOT / "idempotency_mw" / "templates" / "panel").glob("*.html")
    shipped = {f"idempotency_mw/templates/panel/{template.name}" for template in templates}
    assert "idempotency_mw/templates/panel/base.html" in shipped
    assert shipped <= names


def test_cli_from_the_wheel_migrates(built_wheel: Path, tmp_path: Path) -> None:
    """``idempotency-mw migrate`` finds env.py and the revisions inside an installed wheel."""
    site = tmp_path / "site"
    with zipfile.ZipFile(built_wheel) as archive:
        archive.extractall(site)
    database = tmp_path / "app.db"
    result = _run(
        [
            sys.executable,
            "-c",
            "import sys, idempotency_mw.operator.cli as cli; print(cli.__file__); "
            "sys.exit(cli.main(sys.argv[1:]))",
            "migrate",
            "--url",
            f"sqlite:///{database}",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
    )
    assert Path(result.stdout.splitlines()[0]).resolve().is_relative_to(site.resolve())
    snapshot = _on_connection(f"sqlite:///{database}", _snapshot)
    _assert_matches_model(snapshot, "sqlite")
    assert snapshot.versions == [SCHEMA_REVISION]
