"""A PgBouncer of the test's own in transaction mode, in front of the shared PostgreSQL server.

It runs as ``postgres`` (PgBouncer refuses root), on a free port, with a configuration in a
temporary folder, and hands each transaction (or each statement outside one) to whichever of
its few server connections is free, as a production PgBouncer in transaction mode does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import make_url

from tests.support.faults import HOST, _as_owner, end_process, free_port

USER = "postgres"
#: The program, where Debian's package puts it (outside a user's PATH), or ``None``.
PROGRAM = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")


@contextmanager
def pgbouncer(upstream: str) -> Iterator[str]:
    """The URL of ``upstream``'s database through a PgBouncer in transaction mode, for the
    block."""
    assert PROGRAM is not None, "no pgbouncer program"
    parsed = make_url(upstream)
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="idempotency-pgbouncer-"))
    (folder / "users.txt").write_text(f'"{parsed.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n* = host={parsed.host} port={parsed.port or 5432}\n\n"
        f"[pgbouncer]\nlisten_addr = {HOST}\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 3\nmax_client_conn = 100\n"
        "ignore_startup_parameters = extra_float_digits\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
    )
    if _as_owner(USER):
        shutil.chown(folder, USER, USER)  # its log file
    process = subprocess.Popen(
        [PROGRAM, str(folder / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        **_as_owner(USER),
    )
    try:
        _wait_for(port, process, folder / "pgbouncer.log")
        yield parsed.set(host=HOST, port=port).render_as_string(hide_password=False)
    finally:
        end_process(process)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while process.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    said = log.read_text() if log.exists() else ""
    raise RuntimeError(f"pgbouncer did not listen on {port} (exit code {process.poll()}): {said}")
