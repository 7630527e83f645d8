"""TCP ports for the servers the tests start: each pytest-xdist worker draws from a range of
its own, below the kernel's range for outgoing connections, so that two workers never hand out
the same port between one's probe and its server's bind."""

from __future__ import annotations

import itertools
import os
import socket

HOST = "127.0.0.1"
#: Ports per worker; worker ``gwN`` draws from ``10000 + 1000 * (N % 10)`` on (a Redis Cluster
#: node's bus port, 10000 above, stays clear of the outgoing range too).
_SPAN = 1000
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_FIRST = 10000 + _SPAN * (int(_WORKER.removeprefix("gw") or 0) % 10)
_drawn = itertools.count()


def free_ports(count: int) -> list[int]:
    """``count`` different ports that nothing listens on now, none handed out recently."""
    ports: list[int] = []
    for _ in range(_SPAN):
        port = _FIRST + next(_drawn) % _SPAN
        if _bindable(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports from {_FIRST} to {_FIRST + _SPAN - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
        return True
