"""The README's Alembic recipes, followed word for word in a scratch project of a user's own.

Each test makes a project with ``alembic init``, takes env.py, the alembic.ini settings and the
commands from the README's marked blocks, and runs them as a user would, on SQLite, PostgreSQL
and MariaDB (a database of its own on each server). Nothing may be written into the installed
package, and no revision may propose to drop a table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

import idempotency_mw
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import SCHEMA_REVISION, TABLE_NAME
from tests.conftest import DATABASES, SERVER_DATABASES, require_server
from tests.support import warm
from tests.support.readme import commands, marked, settings
from tests.support.scratch import scratch_database

PACKAGE = Path(idempotency_mw.__file__).resolve().parent
BIN = Path(sys.executable).parent
TIMEOUT = 180

MODELS = """\
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    title: Mapped[str] = mapped_column(String(200))
"""
#: The user's change between the first revision and the next.
NOTE_COLUMN = "    note: Mapped[str | None] = mapped_column(String(500))\n"


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An async URL of an empty database: a SQLite file, or a scratch database on a server."""
    name: str = request.param
    if name == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
        return
    require_server(SERVER_DATABASES[name])
    with scratch_database(SERVER_DATABASES[name], "scratch") as url:
        yield async_url(url).render_as_string(hide_password=False)


def _package_files() -> set[Path]:
    return {
        path for path in PACKAGE.rglob("*") if path.is_file() and "__pycache__" not in path.parts
    }


class Project:
    """A user's Alembic project in ``root``, on ``database_url``."""

    def __init__(self, root: Path, database_url: str) -> None:
        self.root = root
        self.env = {
            **{
                k: v
                for k, v in os.environ.items()
                if k not in ("IDEMPOTENCY_DATABASE_URL", "PYTHONPATH")
            },
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "DATABASE_URL": database_url,
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def shell(self, line: str) -> subprocess.CompletedProcess[str]:
        """Run one command line as typed into a shell in the project's folder."""
        return warm.shell(line, cwd=self.root, env=self.env, timeout=TIMEOUT)

    def run(self, line: str) -> str:
        result = self.shell(line)
        assert result.returncode == 0, (
            f"{line!r} exited with {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
        return result.stdout + result.stderr

    def run_block(self, what: str) -> None:
        for line in commands(marked(what)):
            self.run(line)

    def init(self, recipe: str) -> None:
        """``alembic init``, then env.py, alembic.ini's settings and the models from the README."""
        self.run("alembic init -t async alembic")
        (self.root / "alembic" / "env.py").write_text(
            marked(
                "file alembic/env.py (run by Alembic in tests/migrations/test_alembic_project.py)"
            ).text
        )
        ini = self.root / "alembic.ini"
        wanted = settings(marked(f"settings alembic.ini, recipe {recipe}"))
        kept = [
            line
            for line in ini.read_text().splitlines()
            if line.split("=", 1)[0].strip() not in wanted
        ]
        section = kept.index("[alembic]") + 1
        kept[section:section] = [f"{name} = {value}" for name, value in wanted.items()]
        ini.write_text("\n".join(kept) + "\n")
        (self.root / "myapp").mkdir()
        (self.root / "myapp" / "__init__.py").write_text("")
        self.models(MODELS)

    def models(self, source: str) -> None:
        (self.root / "myapp" / "models.py").write_text(source)

    def revisions(self) -> list[str]:
        return [path.read_text() for path in (self.root / "alembic" / "versions").glob("*.py")]


@pytest.fixture
def project(tmp_path: Path, database: str) -> Iterator[Project]:
    before = _package_files()
    root = tmp_path / "project"
    root.mkdir()
    yield Project(root, database)
    written = _package_files() - before
    for path in written:
        # Never leave this test's stray revision in a development checkout; never delete
        # anything else (a file the developer adds while the tests run).
        if "orders" in path.read_text(errors="replace"):
            path.unlink()
    assert not written, f"files written into the installed package: {sorted(written)}"


def _upgrade_part(revision: str) -> str:
    return revision.split("def downgrade", 1)[0]


def _schema(url: str) -> tuple[set[str], set[str], set[str]]:
    """Tables, the columns of ``orders`` (if any), and the revisions in ``alembic_version``."""
    parsed = async_url(url)
    engine = create_engine(parsed.set(drivername=_SYNC_DRIVERS[parsed.get_backend_name()]))
    try:
        with engine.connect() as conn:
            schema = inspect(conn)
            tables = set(schema.get_table_names())
            columns = (
                {column["name"] for column in schema.get_columns("orders")}
                if "orders" in tables
                else set()
            )
            versions = set(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    finally:
        engine.dispose()
    return tables, columns, versions


_SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}


@pytest.mark.parametrize("recipe", ["A", "B"])
def test_readme_recipe_from_first_revision_to_check(project: Project, recipe: str) -> None:
    project.init(recipe)
    project.run_block(f"commands recipe {recipe}, first revision")
    project.models(MODELS + NOTE_COLUMN)
    project.run_block(f"commands recipe {recipe}, later revisions")

    first, later = sorted(project.revisions(), key=lambda source: "add orders.note" in source)
    for revision in (first, later):
        assert "op.drop_" not in _upgrade_part(revision), revision
        assert "idempotency_mw" not in revision  # a user's revision never imports us
    assert "create_table('orders'" in _upgrade_part(first)
    assert "add_column('orders'" in _upgrade_part(later)
    creates_ours = f"create_table('{TABLE_NAME}'" in _upgrade_part(first)
    assert creates_ours is (recipe == "A")

    tables, columns, versions = _schema(project.env["DATABASE_URL"])
    assert {"orders", TABLE_NAME, "alembic_version"} <= tables
    assert "note" in columns
    assert (SCHEMA_REVISION in versions) is (recipe == "B")
    assert len(versions) == (2 if recipe == "B" else 1)


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_revision_that_would_land_in_the_package_is_refused(project: Project) -> None:
    """The command from the issue: a first revision without ``--head`` under recipe B."""
    project.init("B")
    project.run("alembic upgrade heads")
    for line in ('alembic revision --autogenerate -m "create orders"', 'alembic revision -m "x"'):
        result = project.shell(line)
        output = result.stdout + result.stderr  # Alembic prints "FAILED: ..." on stdout
        assert result.returncode != 0, output
        assert "FAILED: idempotency-mw: this revision would be written into" in output
        assert "--head base --branch-label app" in output
    assert project.revisions() == []


def test_moving_from_idempotency_mw_migrate_to_recipe_b(project: Project) -> None:
    """A table made by the CLI: stamped as the README says, then recipe B goes on as usual."""
    project.init("B")
    project.run(f'idempotency-mw migrate --url "{project.env["DATABASE_URL"]}"')
    refused = project.shell("alembic upgrade heads")  # what the README warns about
    assert refused.returncode != 0
    assert TABLE_NAME in refused.stdout + refused.stderr
    project.run_block("commands moving to recipe B")
    project.run_block("commands recipe B, first revision")
    project.models(MODELS + NOTE_COLUMN)
    project.run_block("commands recipe B, later revisions")  # ends with alembic check

    for revision in project.revisions():
        assert "op.drop_" not in _upgrade_part(revision), revision
    tables, columns, versions = _schema(project.env["DATABASE_URL"])
    assert {TABLE_NAME, "idempotency_mw_alembic_version", "orders"} <= tables
    assert "note" in columns
    assert SCHEMA_REVISION in versions
