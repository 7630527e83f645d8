"""The one capped exponential backoff with jitter that every retry loop of the package uses."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays of ``first * factor**attempt`` seconds, capped at ``cap``, of which the fraction
    ``jitter`` is drawn at random (``1.0``: full jitter, anywhere in ``(0, delay]``; ``0``: none),
    so that workers that failed together do not retry together."""

    first: float
    cap: float
    factor: float = 2.0
    jitter: float = 1.0

    def delay(
        self, attempt: int, draw: Callable[[], float] = random.random, *, limit: float = math.inf
    ) -> float:
        """The pause before retry number ``attempt`` (0 for the first retry), at most ``limit``
        (the time left, say: the jitter then spreads below it)."""
        ceiling = max(min(self.cap, self.first * self.factor ** min(attempt, 64), limit), 0.0)
        return ceiling * (1.0 - self.jitter * draw())
