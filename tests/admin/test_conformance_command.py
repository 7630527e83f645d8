"""``idempotency-mw conformance``: the Store contract's cases on the store at a URL, run by
pytest, each printed, nothing left behind, and a failing case makes the command fail."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import redis

from idempotency_mw import ClaimOutcome, SQLStore
from idempotency_mw.operator import conformance
from idempotency_mw.operator.cli import main
from idempotency_mw.testing import CASES
from tests.conftest import REDIS_URL, redis_prefix, require_server

FAST = ["--tick", "0.05"]


def migrated_sqlite(tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / "app.db"
    url = f"sqlite:///{path}"
    assert main(["migrate", "--url", url]) == 0
    return url, path


def assert_every_case_passed(out: str) -> None:
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines[-len(CASES) - 1 : -1]] == [
        ["PASSED", name] for name in CASES
    ]
    assert lines[-1] == f"{len(CASES)} passed, 0 failed, 0 skipped"


def test_the_cases_pass_on_sqlite_and_leave_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, path = migrated_sqlite(tmp_path)
    capsys.readouterr()
    assert main(["conformance", "--store", url, *FAST]) == 0
    assert_every_case_passed(capsys.readouterr().out)
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM idempotency_records").fetchone() == (0,)


def test_a_run_deletes_no_record_but_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = migrated_sqlite(tmp_path)

    async def foreign_expired() -> str:
        """A record of the app's, expired (its TTL and lease ended), awaiting its purge."""
        store = SQLStore(url)
        try:
            claim = await store.claim("app", "k", "f", ttl=0.01, lease=0.01)
            assert claim.outcome is ClaimOutcome.ACQUIRED
            while (await store.record_stats()).expired != 1:  # noqa: ASYNC110 (polls the store)
                await anyio.sleep(0.01)
        finally:
            await store.aclose()
        return store.record_ref("app", "k")

    async def found(ref: str) -> bool:
        store = SQLStore(url)
        try:
            return await store.find_record(ref) is not None
        finally:
            await store.aclose()

    ref = anyio.run(foreign_expired)
    capsys.readouterr()
    assert main(["conformance", "--store", url, *FAST]) == 0
    assert_every_case_passed(capsys.readouterr().out)
    assert anyio.run(found, ref)


def test_the_cases_pass_on_redis_and_leave_no_key(capsys: pytest.CaptureFixture[str]) -> None:
    require_server(REDIS_URL)
    prefix = redis_prefix("conformance")
    assert main(["conformance", "--store", REDIS_URL, "--prefix", prefix, *FAST]) == 0
    assert_every_case_passed(capsys.readouterr().out)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert list(client.scan_iter(match=f"{prefix}*")) == []
    finally:
        client.close()


def test_a_failing_case_fails_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A database that refuses large rows cannot keep a large response for its replay.
    url, path = migrated_sqlite(tmp_path)
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TRIGGER small_rows BEFORE UPDATE OF result_payload ON idempotency_records "
            "WHEN length(NEW.result_payload) > 1000000 BEGIN SELECT RAISE(ABORT, 'too large'); END"
        )
    capsys.readouterr()
    cases = ["scopes_are_isolated", "a_large_binary_response_round_trips"]
    code = main(["conformance", "--url", url, *(f"--case={case}" for case in cases)])
    out, err = capsys.readouterr()
    assert code == 1
    passed, failed, summary = out.splitlines()
    assert passed.startswith("PASSED  scopes_are_isolated (")
    assert failed.startswith("FAILED  a_large_binary_response_round_trips (")
    assert "StoreError: complete on SQLStore" in failed
    assert failed.endswith("too large")
    assert summary == "1 passed, 1 failed, 0 skipped"
    assert err == (
        "idempotency-mw: the store broke the contract: pytest's report above names each case\n"
    )


def test_an_unknown_case_is_refused_with_the_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = migrated_sqlite(tmp_path)
    capsys.readouterr()
    assert main(["conformance", "--store", url, "--case", "keys_are_exact", "--case", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("idempotency-mw: no such case: nope (the cases: first_claim_acquires")


def test_memory_store_and_the_other_commands_need_no_pytest() -> None:
    # Only the cases import pytest: MemoryStore serves demos and benchmarks without it.
    without = (
        "import sys; sys.modules['pytest'] = None; "
        "from idempotency_mw.testing import MemoryStore; "
        "from idempotency_mw.operator.cli import main; "
        "sys.exit(main(['--version']))"
    )
    ran = subprocess.run([sys.executable, "-c", without], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr


def test_without_pytest_the_command_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = migrated_sqlite(tmp_path)
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "pytest", None)  # as if it were not installed
    assert main(["conformance", "--store", url]) == 2
    assert capsys.readouterr().err == (
        "idempotency-mw: this needs pytest: install the [conformance] extra (pip install "
        "'idempotency-mw[conformance]', or from a checkout: pip install -e '.[conformance]')\n"
    )


def test_a_store_without_its_table_is_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    assert main(["conformance", "--store", f"sqlite:///{path}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "idempotency-mw migrate" in err


def test_the_folders_pytest_settings_and_conftest_are_not_the_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Run from an application's checkout: its pytest settings, conftest and cache are its own.
    url, _ = migrated_sqlite(tmp_path)
    app = tmp_path / "app"
    app.mkdir()
    (app / "pytest.ini").write_text("[pytest]\naddopts = --no-such-option\n")
    (app / "conftest.py").write_text("raise RuntimeError('the application conftest')\n")
    monkeypatch.chdir(app)
    capsys.readouterr()
    assert main(["conformance", "--store", url, "--case", "scopes_are_isolated"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 passed, 0 failed, 0 skipped"
    assert sorted(path.name for path in app.iterdir()) == ["conftest.py", "pytest.ini"]
    assert not (Path(conformance.__file__).parent / ".pytest_cache").exists()
