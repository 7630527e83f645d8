"""ReplyWait: a store waits for its server's reply with the event loop kept awake for a moment,
and lets it sleep at once while replies come too late. Observed on the loop's own poll: a poll
that may not wait (timeout 0) means the loop was kept awake."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from idempotency_mw.stores.replies import ReplyWait


class CountingSelector(selectors.DefaultSelector):
    """The loop's selector, keeping the timeout of every poll."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> list[Any]:
        self.timeouts.append(timeout)
        result: list[Any] = super().select(timeout)
        return result

    def awake_polls(self, since: int = 0) -> int:
        return sum(1 for timeout in self.timeouts[since:] if timeout == 0)


def on_counted_loop(main: Callable[[CountingSelector], Coroutine[Any, Any, None]]) -> None:
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(main(selector))
    finally:
        loop.close()


def answered_after(seconds: float) -> asyncio.Future[str]:
    pending: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    pending.get_loop().call_later(seconds, pending.set_result, "reply")
    return pending


async def waited(waiting: ReplyWait, selector: CountingSelector, seconds: float) -> int:
    """The polls that did not sleep while ``waiting`` waited for a reply after ``seconds``."""
    since = len(selector.timeouts)
    assert await waiting.wait(answered_after(seconds)) == "reply"
    return selector.awake_polls(since)


def test_the_loop_is_kept_awake_until_the_reply_comes() -> None:
    async def main(selector: CountingSelector) -> None:
        since = len(selector.timeouts)
        assert await ReplyWait(limit=1.0).wait(answered_after(0.005)) == "reply"
        polls = selector.timeouts[since:]
        # It never slept: without the wait, the first poll would sleep the 5 ms.
        assert len(polls) > 10
        assert all(timeout == 0 for timeout in polls)

    on_counted_loop(main)


def test_the_loop_is_let_sleep_at_the_limit() -> None:
    async def main(selector: CountingSelector) -> None:
        since = len(selector.timeouts)
        assert await ReplyWait(limit=0.001).wait(answered_after(0.1)) == "reply"
        # A turn of an idle loop takes microseconds: kept awake for the whole 100 ms, it
        # would have polled tens of thousands of times; for 1 ms of it, hundreds.
        assert selector.awake_polls(since) < 5_000
        assert any(timeout for timeout in selector.timeouts[since:])

    on_counted_loop(main)


def test_replies_that_come_too_late_keep_the_loop_awake_ever_less_often() -> None:
    async def main(selector: CountingSelector) -> None:
        waiting = ReplyWait(limit=0.005)
        kept_awake = [await waited(waiting, selector, 0.015) > 5 for _ in range(20)]
        # Tried on the 1st, 3rd, 7th and 15th wait: each miss doubles the waits that skip it.
        assert [n for n, awake in enumerate(kept_awake, 1) if awake] == [1, 3, 7, 15]

    on_counted_loop(main)


def test_a_reply_in_time_makes_every_wait_keep_the_loop_awake_again() -> None:
    # Replies in time come after 3 ms, too late after 300: far from the 250 ms limit on either
    # side (a busy machine can only make a reply later, and must stall the process for a
    # quarter of a second to make one in time miss).
    async def main(selector: CountingSelector) -> None:
        waiting = ReplyWait(limit=0.25)
        for _ in range(3):  # misses on the 1st and 3rd: the next 3 waits skip it
            await waited(waiting, selector, 0.3)
        for _ in range(3):
            assert await waited(waiting, selector, 0.003) <= 5
        for _ in range(5):
            assert await waited(waiting, selector, 0.003) > 5
        # The misses were forgotten: one more skips one wait, not 7.
        await waited(waiting, selector, 0.3)
        assert await waited(waiting, selector, 0.003) <= 5
        assert await waited(waiting, selector, 0.003) > 5

    on_counted_loop(main)


def test_a_cancelled_wait_lets_the_loop_sleep() -> None:
    async def main(selector: CountingSelector) -> None:
        pending: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        command = asyncio.ensure_future(ReplyWait(limit=1.0).wait(pending))
        await asyncio.sleep(0.001)
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
        assert pending.cancelled()  # no reply settles a future nobody reads
        await asyncio.sleep(0.001)
        since = len(selector.timeouts)
        await asyncio.sleep(0.01)
        # Not kept awake for the rest of the second: the loop slept through the 10 ms.
        assert selector.awake_polls(since) <= 2

    on_counted_loop(main)
