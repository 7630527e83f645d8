"""Lease keepers start a third of the lease after the claim, one loop timer for all the work."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from idempotency_mw.lease import KeeperStarts, LoopStarts


def starts_on(loop_starts: LoopStarts, log: list[str]) -> Callable[[str, float], None]:
    """``add(name, delay)``: work called ``name`` whose keeper, when it starts, logs its name."""

    def add(name: str, delay: float) -> None:
        loop_starts.add(name, delay, lambda: log.append(name))

    return add


def test_work_still_running_when_its_start_is_due_gets_its_keeper() -> None:
    started: list[str] = []

    async def run() -> None:
        add = starts_on(KeeperStarts().on_this_loop(), started)
        for name, delay in (("slow", 0.05), ("slower", 0.1), ("quick", 0.02)):
            add(name, delay)
        await asyncio.sleep(0.01)
        assert started == []
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert started == ["quick", "slow", "slower"]


def test_work_that_ended_before_its_start_never_gets_a_keeper() -> None:
    started: list[str] = []

    async def run() -> None:
        loop_starts = KeeperStarts().on_this_loop()
        add = starts_on(loop_starts, started)
        add("ended", 0.02)
        add("running", 0.04)
        loop_starts.discard("ended")
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert started == ["running"]


def test_work_on_the_next_event_loop_gets_its_keeper() -> None:
    # An engine serves one test client's loop after another's: the closed loop's timer is gone.
    starts = KeeperStarts()
    started: list[str] = []

    async def run(name: str) -> None:
        starts_on(starts.on_this_loop(), started)(name, 0.02)
        await asyncio.sleep(0.01 if name == "first" else 0.1)

    asyncio.run(run("first"))
    asyncio.run(run("second"))
    assert started == ["second"]


def test_closed_starts_start_nothing() -> None:
    starts = KeeperStarts()
    started: list[str] = []

    async def run() -> None:
        starts_on(starts.on_this_loop(), started)("work", 0.02)
        starts.close()
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert started == []
