"""TCP ports for the servers the tests start, below the kernel's range for outgoing connections.

Each pytest-xdist worker draws from a range of its own, and reserves each port it hands out
with a lock on a file of the machine's temporary folder, held until the process ends: a
concurrent run of the suite on the same machine has workers of the same names, and without the
lock drew the same ports (a server of one run failed to bind a port the other had just taken,
or took over the port of a server the other had stopped to start again).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import tempfile
from pathlib import Path

HOST = "127.0.0.1"
#: Ports per worker; worker ``gwN`` draws from ``10000 + 1000 * (N % 10)`` on (a Redis Cluster
#: node's bus port, 10000 above, stays clear of the outgoing range too).
_SPAN = 1000
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_FIRST = 10000 + _SPAN * (int(_WORKER.removeprefix("gw") or 0) % 10)
_drawn = itertools.count()
_LOCKS = Path(tempfile.gettempdir()) / "idempotency-mw-test-ports"
#: The lock files this process holds, by port: the kernel releases them when it ends.
_reserved: dict[int, int] = {}


def free_ports(count: int) -> list[int]:
    """``count`` different ports that nothing listens on now, none handed out recently, and
    none handed out by another process of this machine that still runs."""
    ports: list[int] = []
    for _ in range(_SPAN):
        port = _FIRST + next(_drawn) % _SPAN
        if _reserve(port) and _bindable(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports from {_FIRST} to {_FIRST + _SPAN - 1}")


def _reserve(port: int) -> bool:
    if port in _reserved:
        return True
    _LOCKS.mkdir(mode=0o777, exist_ok=True)
    try:
        lock = os.open(_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's run holds it
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return False
    _reserved[port] = lock
    return True


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
        return True
