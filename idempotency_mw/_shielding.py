"""Shielding a call from cancellation, paid for only when it actually waits."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")


class shielded(Generic[T]):
    """``await shielded(start)`` runs the awaitable ``start()`` makes to its end even when the
    task is cancelled meanwhile, as ``with anyio.CancelScope(shield=True): await start()``
    does.

    The shield is entered only when the awaitable first suspends: cancellation is delivered
    only to a suspended task, so one that ends without suspending (a store call answered from
    memory, say) needs none, and does not pay for entering it. One that first suspends on a
    bare yield in a scope already cancelled may be anyio code waiting for that cancellation
    (``checkpoint_if_cancelled``), which a shield entered now would keep waiting for ever: it
    is closed and ``start()`` is called again, shielded from the start. (A store call may be
    sent twice: the store protocol acknowledges a completion or a release delivered twice.)
    """

    __slots__ = ("_start",)

    def __init__(self, start: Callable[[], Awaitable[T]]) -> None:
        self._start = start

    def __await__(self) -> Generator[Any, Any, T]:
        steps = self._start().__await__()
        try:
            suspended_on = steps.send(None)
        except StopIteration as done:
            result: T = done.value
            return result
        if suspended_on is None and anyio.current_effective_deadline() == -math.inf:
            steps.close()
            with anyio.CancelScope(shield=True):  # noqa: ASYNC100  (the yield from suspends)
                return (yield from self._start().__await__())
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100  (the yield from suspends)
            result = yield from _resumed(steps, suspended_on)
        return result


def _resumed(steps: Generator[Any, Any, T], suspended_on: Any) -> Generator[Any, Any, T]:
    """Drive ``steps`` (an awaitable's iterator), suspended on ``suspended_on``, to its end
    (as ``yield from`` would have from its start)."""
    while True:
        try:
            sent = yield suspended_on
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # thrown in by the task: the awaitable's to handle
            try:
                suspended_on = steps.throw(exc)
            except StopIteration as done:
                result: T = done.value
                return result
            continue
        try:
            suspended_on = steps.send(sent)
        except StopIteration as done:
            result = done.value
            return result
