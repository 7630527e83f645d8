"""``with thing:`` (``async with thing:``) closes it at the end of the block."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class ClosedOnExit(abc.ABC):
    """Closes itself when a ``with`` block ends."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the object opened."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AClosedOnExit(abc.ABC):
    """Closes itself when an ``async with`` block ends."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release what the object opened."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
