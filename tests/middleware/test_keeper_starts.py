"""Lease keepers start a third of the lease after the claim, one loop timer for all the work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from idempotency_mw.lease import KeeperStarts, LoopStarts

#: When each named work was due to start, and when it started (the loop's clock).
Log = list[tuple[str, float, float]]


def starts_on(loop_starts: LoopStarts, log: Log) -> Callable[[str, float], None]:
    """``add(name, delay)``: work called ``name`` whose keeper, when it starts, is logged."""

    def add(name: str, delay: float) -> None:
        due = loop_starts.loop.time() + delay
        loop_starts.add(name, delay, lambda: log.append((name, due, loop_starts.loop.time())))

    return add


def test_work_still_running_when_its_start_is_due_gets_its_keeper() -> None:
    log: Log = []

    async def run() -> None:
        add = starts_on(KeeperStarts().on_this_loop(), log)
        for name, delay in (("slow", 0.05), ("slower", 0.1), ("quick", 0.02)):
            add(name, delay)
        await asyncio.sleep(0.3)

    asyncio.run(run())
    assert [name for name, _, _ in log] == ["quick", "slow", "slower"]
    assert all(started >= due for _, due, started in log), log  # none before its time


def test_work_that_ended_before_its_start_never_gets_a_keeper() -> None:
    log: Log = []

    async def run() -> None:
        loop_starts = KeeperStarts().on_this_loop()
        add = starts_on(loop_starts, log)
        add("ended", 0.02)
        add("running", 0.04)
        loop_starts.discard("ended")
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert [name for name, _, _ in log] == ["running"]


def test_work_on_the_next_event_loop_gets_its_keeper() -> None:
    # An engine serves one test client's loop after another's: the closed loop's timer is gone.
    starts = KeeperStarts()
    log: Log = []

    async def run(name: str, delay: float) -> None:
        starts_on(starts.on_this_loop(), log)(name, delay)
        await asyncio.sleep(0.2)

    asyncio.run(run("first", 60))  # ends with its loop, long before its start
    asyncio.run(run("second", 0.02))
    assert [name for name, _, _ in log] == ["second"]


def test_closed_starts_start_nothing() -> None:
    starts = KeeperStarts()
    log: Log = []

    async def run() -> None:
        starts_on(starts.on_this_loop(), log)("work", 0.02)
        starts.close()
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert log == []
