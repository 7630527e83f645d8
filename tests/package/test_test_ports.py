"""The ports the tests' servers take: two runs of the suite on one machine never share one."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.ports import free_ports

#: Another process, as a concurrent run's worker of the same name: a draw of every port of
#: its range (each draw moves on at least one).
DRAW_ALL = """
from tests.support.ports import free_ports
print(*(free_ports(1)[0] for _ in range(1000)))
"""


def test_a_concurrent_run_never_draws_the_ports_this_run_drew() -> None:
    ours = free_ports(3)  # handed out, their servers not started yet
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    other = subprocess.run(
        [sys.executable, "-c", DRAW_ALL],
        env={**os.environ, "PYTEST_XDIST_WORKER": worker},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    theirs = {int(port) for port in other.stdout.split()}
    assert theirs  # it drew from the same range
    assert theirs.isdisjoint(ours)
