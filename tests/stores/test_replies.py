"""ReplyWait: how the Redis connection waits for a reply, yielding first while replies come fast."""

from __future__ import annotations

import asyncio

import pytest

from idempotency_mw.stores.redis.replies import ReplyWait

pytestmark = pytest.mark.anyio


class CountedFuture(asyncio.Future[str]):
    """A future that counts how often its waiter looked at it."""

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


async def test_a_reply_that_comes_while_the_waiter_yields_is_taken() -> None:
    pending = answered_in_two_turns()
    assert await ReplyWait(limit=0.05).reply(pending) == "reply"
    assert pending.looks >= 3  # it yielded and looked again, instead of sleeping at once


async def test_the_yielding_ends_at_the_limit() -> None:
    pending = answered_after(0.1)
    assert await ReplyWait(limit=0.001).reply(pending) == "reply"
    # A turn of an idle loop takes microseconds: yielding for the whole 100 ms would have
    # looked tens of thousands of times; 1 ms of it, hundreds.
    assert pending.looks < 5_000


async def test_replies_that_come_too_late_make_the_waits_yield_ever_less_often() -> None:
    waiting = ReplyWait(limit=0.001)
    yielded = []
    for _ in range(20):
        pending = answered_after(0.003)
        assert await waiting.reply(pending) == "reply"
        yielded.append(pending.looks > 1)
    # Tried on the 1st, 3rd, 7th and 15th wait: each miss doubles the waits that skip it.
    assert [n for n, tried in enumerate(yielded, 1) if tried] == [1, 3, 7, 15]


async def test_a_reply_in_time_makes_every_wait_yield_again() -> None:
    waiting = ReplyWait(limit=0.002)
    for _ in range(3):  # three misses: the next 7 waits would go asleep at once
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


async def test_a_caller_cancelled_while_yielding_cancels_its_reply() -> None:
    pending = CountedFuture()
    caller = asyncio.ensure_future(ReplyWait(limit=1.0).reply(pending))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    # Otherwise a reply (or a lost connection's error) would settle a future nobody reads.
    assert pending.cancelled()
