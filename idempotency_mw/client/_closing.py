"""``with thing:`` closes it at the end of the block."""

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
