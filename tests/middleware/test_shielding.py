"""A settlement's store call runs to its end even when the request is cancelled meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import pytest

from idempotency_mw._shielding import shielded

pytestmark = pytest.mark.anyio


async def test_a_coroutine_that_never_suspends_gives_its_result() -> None:
    async def answer() -> str:
        return "recorded"

    assert await shielded(answer) == "recorded"


async def test_a_coroutine_suspended_when_its_scope_is_cancelled_runs_to_its_end() -> None:
    finished: list[str] = []

    async def record() -> str:
        await asyncio.sleep(0.05)
        finished.append("record")
        return "recorded"

    async def settle(scope: anyio.CancelScope) -> str:
        with scope:
            return await shielded(record)
        raise AssertionError("the shielded call was cut short")

    scope = anyio.CancelScope()
    settling = asyncio.ensure_future(settle(scope))
    await asyncio.sleep(0.01)
    scope.cancel()
    assert await settling == "recorded"
    assert finished == ["record"]


async def settled_in_a_scope_it_cancelled(record: Callable[[], Awaitable[str]]) -> str:
    """``record`` shielded, in a scope the task cancelled without suspending since."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        return await shielded(record)
    raise AssertionError("the shielded call was cut short")


async def test_anyio_code_in_a_scope_cancelled_before_it_ran_runs_to_its_end() -> None:
    # The scope was cancelled by the task itself, which has not suspended since: anyio code
    # sees that before its first suspension (entering the shield only then would leave it
    # waiting for a cancellation that the shield holds back, for ever): it is started again,
    # shielded from the start.
    started: list[str] = []

    async def record() -> str:
        started.append("record")
        await anyio.lowlevel.checkpoint_if_cancelled()
        await asyncio.sleep(0.01)
        return "recorded"

    assert await asyncio.wait_for(settled_in_a_scope_it_cancelled(record), 5) == "recorded"
    assert started == ["record", "record"]


async def test_a_call_that_first_waits_on_a_future_in_a_cancelled_scope_runs_once() -> None:
    # No anyio code saw the cancellation before the call suspended: the shield entered then
    # holds it back, and the call is not started again.
    started: list[str] = []

    async def record() -> str:
        started.append("record")
        await asyncio.sleep(0.01)
        return "recorded"

    assert await asyncio.wait_for(settled_in_a_scope_it_cancelled(record), 5) == "recorded"
    assert started == ["record"]


async def test_an_error_inside_reaches_the_caller() -> None:
    async def fail() -> None:
        await asyncio.sleep(0)
        raise LookupError("the store failed")

    with pytest.raises(LookupError, match="the store failed"):
        await shielded(fail)


async def test_a_task_cancelled_by_asyncio_itself_is_told_inside_the_coroutine() -> None:
    # As with anyio's shield, which holds back anyio's cancellation only: the coroutine sees a
    # plain task.cancel() where it waits, and may handle it.
    seen: list[str] = []

    async def record() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def settle() -> None:
        await shielded(record)

    task = asyncio.ensure_future(settle())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]
