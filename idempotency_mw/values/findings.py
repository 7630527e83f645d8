"""What a store's server is set to that can lose records: the values of ``idempotency-mw check``
and of the start-up warnings (:mod:`idempotency_mw.stores.checks`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Severity(enum.StrEnum):
    """Whether a finding can lose records."""

    #: A record can be lost early, and its key run again: ``check`` exits 1, start-up warns.
    RISK = "risk"
    #: Nothing known to be lost, but the check could not tell (a managed server refusing
    #: ``CONFIG``): worth a look in the provider's settings.
    NOTE = "note"


@dataclass(frozen=True, slots=True)
class Finding:
    """One setting of the store's server (or of the app against it): what it is, what it can
    lose, and what fixes it."""

    setting: str
    found: str
    risk: str
    fix: str
    severity: Severity = Severity.RISK

    def __str__(self) -> str:
        return f"{self.severity}: {self.setting} is {self.found}: {self.risk}. Fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class ServerCheck:
    """What a store read of its server: the findings, and the server's clock when it has one
    of its own (Unix seconds; ``None``: the app's machine keeps it, as SQLite's)."""

    findings: tuple[Finding, ...]
    now: float | None = None
