"""ReplyWait: how the Redis connection waits for a reply, keeping the loop awake while replies come
fast."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_mw.stores.redis.replies import ReplyWait

pytestmark = pytest.mark.anyio


class CountedFuture(asyncio.Future[str]):
    """A future that counts how often it was looked at."""

    looks = 0

    def done(self) -> bool:
        self.looks += 1
        return super().done()


def answered_after(seconds: float) -> CountedFuture:
    pending = CountedFuture()
    pending.get_loop().call_later(seconds, pending.set_result, "reply")
    return pending


def answered_in_two_turns() -> CountedFuture:
    pending = CountedFuture()
    loop = pending.get_loop()
    loop.call_soon(loop.call_soon, pending.set_result, "reply")
    return pending


async def test_the_loop_is_kept_awake_until_the_reply_comes() -> None:
    pending = answered_in_two_turns()
    assert await ReplyWait(limit=0.05).reply(pending) == "reply"
    assert pending.looks >= 3  # looked at again on the next turn, instead of sleeping at once


async def test_the_loop_is_let_sleep_at_the_limit() -> None:
    pending = answered_after(0.1)
    assert await ReplyWait(limit=0.001).reply(pending) == "reply"
    # A turn of an idle loop takes microseconds: kept awake for the whole 100 ms, it would have
    # looked tens of thousands of times; for 1 ms of it, hundreds.
    assert pending.looks < 5_000


async def test_replies_that_come_too_late_keep_the_loop_awake_ever_less_often() -> None:
    waiting = ReplyWait(limit=0.001)
    kept_awake = []
    for _ in range(20):
        pending = answered_after(0.003)
        assert await waiting.reply(pending) == "reply"
        kept_awake.append(pending.looks > 1)
    # Tried on the 1st, 3rd, 7th and 15th wait: each miss doubles the waits that skip it.
    assert [n for n, tried in enumerate(kept_awake, 1) if tried] == [1, 3, 7, 15]


async def test_a_reply_in_time_makes_every_wait_keep_the_loop_awake_again() -> None:
    waiting = ReplyWait(limit=0.002)
    for _ in range(3):  # three misses: the next 7 waits let the loop sleep at once
        await waiting.reply(answered_after(0.005))
    for _ in range(7):
        await waiting.reply(answered_in_two_turns())
    for _ in range(5):
        pending = answered_in_two_turns()
        await waiting.reply(pending)
        assert pending.looks >= 3
    # The misses were forgotten: one more skips one wait, not 15.
    await waiting.reply(answered_after(0.005))
    await waiting.reply(answered_in_two_turns())
    pending = answered_in_two_turns()
    await waiting.reply(pending)
    assert pending.looks >= 3


async def test_a_cancelled_caller_lets_the_loop_sleep() -> None:
    pending = CountedFuture()
    waiting = ReplyWait(limit=1.0)

    async def command() -> str:
        return await waiting.reply(pending)

    caller = asyncio.ensure_future(command())
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert pending.cancelled()  # no reply settles a future nobody reads
    looks = pending.looks
    for _ in range(5):
        await asyncio.sleep(0)
    assert pending.looks == looks  # not kept awake for the rest of the second
