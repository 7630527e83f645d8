"""Shielding a coroutine from cancellation, paid for only when it actually waits."""

from __future__ import annotations

import math
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

import anyio

T = TypeVar("T")


class shielded(Generic[T]):
    """``await shielded(coroutine)`` runs ``coroutine`` to its end even when the task is
    cancelled meanwhile, as ``with anyio.CancelScope(shield=True): await coroutine`` does.

    The shield is entered only when the coroutine first suspends: cancellation is delivered
    only to a suspended task, so a coroutine that ends without suspending (a store call
    answered from memory, say) needs none, and does not pay for entering it.
    """

    __slots__ = ("_coroutine",)

    def __init__(self, coroutine: Coroutine[Any, Any, T]) -> None:
        self._coroutine = coroutine

    def __await__(self) -> Generator[Any, Any, T]:
        coroutine = self._coroutine
        if anyio.current_effective_deadline() == -math.inf:
            # Cancelled already: anyio code in the coroutine would see it before it suspends.
            with anyio.CancelScope(shield=True):  # noqa: ASYNC100  (the yield from suspends)
                return (yield from coroutine.__await__())
        try:
            suspended_on = coroutine.send(None)
        except StopIteration as done:
            result: T = done.value
            return result
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100  (the yield from suspends)
            result = yield from _resumed(coroutine, suspended_on)
        return result


def _resumed(coroutine: Coroutine[Any, Any, T], suspended_on: Any) -> Generator[Any, Any, T]:
    """Drive ``coroutine``, suspended on ``suspended_on``, to its end (as ``yield from``
    would have from its start)."""
    while True:
        try:
            sent = yield suspended_on
        except GeneratorExit:
            coroutine.close()
            raise
        except BaseException as exc:  # thrown in by the task: the coroutine's to handle
            try:
                suspended_on = coroutine.throw(exc)
            except StopIteration as done:
                result: T = done.value
                return result
            continue
        try:
            suspended_on = coroutine.send(sent)
        except StopIteration as done:
            result = done.value
            return result
