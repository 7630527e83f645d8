"""The source distribution: it builds, and once unpacked its alembic.ini migrates a database."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from idempotency_mw.stores.sql.schema import TABLE_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _run(args: list[str], cwd: Path, **env: str) -> str:
    base = {
        k: v for k, v in os.environ.items() if k not in ("IDEMPOTENCY_DATABASE_URL", "PYTHONPATH")
    }
    result = subprocess.run(
        args,
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def unpacked_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    _run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), "."], REPO_ROOT
    )
    (archive,) = out.glob("idempotency_mw-*.tar.gz")
    with tarfile.open(archive) as sdist:
        sdist.extractall(out, filter="data")
    (root,) = (path for path in out.iterdir() if path.is_dir())
    return root


def test_sdist_ships_alembic_ini_and_the_migrations(unpacked_sdist: Path) -> None:
    for name in ("alembic.ini", "migrations/env.py", "idempotency_mw/migrations/env.py"):
        assert (unpacked_sdist / name).is_file(), name
    assert sorted(
        p.name for p in (unpacked_sdist / "migrations" / "versions").glob("*.py")
    ) == sorted(
        p.name for p in (REPO_ROOT / "idempotency_mw" / "migrations" / "versions").glob("*.py")
    )


def test_unpacked_sdist_migrates_with_its_alembic_ini(unpacked_sdist: Path, tmp_path: Path) -> None:
    database = tmp_path / "app.db"
    url = f"sqlite:///{database}"
    alembic = str(Path(sys.executable).parent / "alembic")
    _run([alembic, "upgrade", "head"], unpacked_sdist, IDEMPOTENCY_DATABASE_URL=url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            assert TABLE_NAME in inspect(conn).get_table_names()
    finally:
        engine.dispose()
    _run([alembic, "downgrade", "base"], unpacked_sdist, IDEMPOTENCY_DATABASE_URL=url)


def test_unpacked_sdist_builds_a_wheel_with_the_migrations(
    unpacked_sdist: Path, tmp_path: Path
) -> None:
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        unpacked_sdist,
    )
    (wheel,) = tmp_path.glob("idempotency_mw-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "idempotency_mw/migrations/versions/0001_idempotency_records.py" in names
    assert not any(name.startswith("migrations/") for name in names)
