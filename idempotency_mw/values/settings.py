"""A call's settings, described once, for every entry.

:class:`RouteOptions` names them and their types for type checkers: the keyword arguments of
``@idempotent``, the values of the middleware's ``routes`` mapping and the middleware's own
defaults; :class:`CallOptions`, its part that every call has, is what idempotent functions and
MCP tools take. :class:`Settings` is what a call runs with: each setting's default and its
validation. :func:`overrides` validates the settings given by name, whichever entry gives them,
and :meth:`Settings.merge` lays a route's over the defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal, TypedDict

from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.key_sources import KeySource

#: What becomes of work whose lease could not be proven: stopped, or left to go on unprotected.
LeaseLostAction = Literal["cancel", "continue"]

#: A length of time: seconds, or a timedelta.
Duration = float | timedelta
#: How a request body enters the fingerprint: its bytes, or (JSON bodies) its canonical JSON.
FingerprintMode = Literal["bytes", "json"]


class CallOptions(TypedDict, total=False):
    """The settings of every idempotent call: an HTTP request's, an idempotent function's, an
    MCP tool call's. A route's setting that is not given is the middleware's; the defaults
    named here are those of the middleware, idempotent functions and MCP tools."""

    ttl: Duration
    """How long a completed call's response (or result) is replayed: 24 hours by default.
    Longer than ``lease``, and than the longest time the callers retry for."""
    lease: Duration
    """How long a call in progress holds its key without a renewal (renewed while it runs;
    a crashed worker's key is taken over once it lapses): 60 seconds by default."""
    wait: Duration
    """How long a repeat that finds its key in progress waits for the first call's outcome
    before it is refused as in progress: 0 by default."""
    fenced: bool
    """``True`` when the call (an endpoint, a function, a tool) commits its effect with
    ``fence()``: the claim and the completion then skip their own flush to disk where the
    store's database allows it (the fenced commit decides; a call that returns without
    ``fence()`` is recorded durably, and logged once). ``False`` by default."""


class RouteOptions(CallOptions, total=False):
    """The settings of an HTTP route: ``@idempotent(**options)``, the values of the
    middleware's ``routes`` mapping, and the middleware's defaults for every route (given to
    it by name). Those of :class:`CallOptions` and:"""

    required: bool
    """Whether requests without a key are rejected with 400: ``False`` by default."""
    fingerprint: FingerprintMode
    """``"json"`` compares JSON bodies by content, not bytes: ``"bytes"`` by default."""
    release_statuses: Iterable[int]
    """4xx answers of the endpoint that prove it did nothing, so the key is released instead
    of recorded: none by default (every answer below 500 is recorded)."""
    max_request_bytes: int
    """The largest keyed request body the route fingerprints (413 above): 1 MiB by default."""
    key: KeySource
    """Where the route's requests carry their key: ``from_header("webhook-id")``, or
    ``from_json("data.object.id")`` for a field of a JSON body; the middleware's
    ``header_name`` by default. Keys so found are the route's own: the same key on another
    route is another request (unless ``@idempotent(scope=...)`` names a shared scope)."""


def to_seconds(value: Duration, name: str, *, zero: bool = False) -> float:
    """Seconds from a number or a timedelta; anything else, or not positive (with ``zero``:
    negative), is a configuration error."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        seconds = float("nan")
    if not (seconds >= 0 if zero else seconds > 0):
        least = "0 or more" if zero else "more than 0"
        raise ConfigurationError(f"{name} must be a duration of {least} seconds, got {value!r}")
    return seconds


def _not_negative(value: Duration, name: str) -> float:
    return to_seconds(value, name, zero=True)


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def _fingerprint_mode(value: object, name: str) -> FingerprintMode:
    if value == "bytes":
        return "bytes"
    if value == "json":
        return "json"
    raise ConfigurationError(f"{name} must be 'bytes' or 'json', got {value!r}")


def _statuses(value: object, name: str) -> frozenset[int]:
    """HTTP statuses from 400 to 499: only refusals may release a key."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigurationError(f"{name} must be a collection of 4xx statuses, got {value!r}")
    found = frozenset(value)
    wrong = sorted(repr(v) for v in found if not _is_refusal(v))
    if wrong:
        raise ConfigurationError(f"{name} must be 4xx statuses, got {wrong}")
    return found


def _is_refusal(status: object) -> bool:
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 499


def _key_source(value: object, name: str) -> KeySource:
    if not isinstance(value, KeySource):
        raise ConfigurationError(
            f"{name} must be from_header(...) or from_json(...), got {value!r}"
        )
    return value


def _byte_count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{name} must be a number of bytes (0 or more), got {value!r}")
    return value


#: A field's metadata: what turns a value a user gives (and the setting's name) into the value
#: kept, or raises :class:`ConfigurationError`.
_CHECK = "check"


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings one call runs with: the fields of :class:`RouteOptions`, validated, each
    with its default; the middleware's defaults are these, given by name."""

    ttl: float = field(default=24 * 3600.0, metadata={_CHECK: to_seconds})
    lease: float = field(default=60.0, metadata={_CHECK: to_seconds})
    wait: float = field(default=0.0, metadata={_CHECK: _not_negative})
    required: bool = field(default=False, metadata={_CHECK: _flag})
    fingerprint: FingerprintMode = field(default="bytes", metadata={_CHECK: _fingerprint_mode})
    release_statuses: frozenset[int] = field(default=frozenset(), metadata={_CHECK: _statuses})
    fenced: bool = field(default=False, metadata={_CHECK: _flag})
    max_request_bytes: int = field(default=1 << 20, metadata={_CHECK: _byte_count})
    #: ``None``: the middleware's ``header_name`` (and its OASIS request id header).
    key: KeySource | None = field(default=None, metadata={_CHECK: _key_source})
    #: Set by ``@idempotent(scope=...)``, never by name: the caller's scope comes from the
    #: endpoint's dependency.
    scoped: bool = False

    def __post_init__(self) -> None:
        outlives(self.ttl, self.lease)

    def merge(self, overrides: Overrides | None) -> Settings:
        """These settings, with what ``overrides`` sets instead."""
        return self if not overrides else replace(self, **overrides)


def outlives(ttl: float, lease: float, where: str = "") -> None:
    """Raise :class:`ConfigurationError` unless a record kept ``ttl`` seconds outlives a
    ``lease``: a call's retries come until its lease lapses (its worker may have died), and
    must find its record."""
    if ttl <= lease:
        raise ConfigurationError(
            f"ttl must be longer than lease{where}, got ttl={ttl:g} s and lease={lease:g} s: "
            "a retry that comes once the lease lapsed would find no record, and run again"
        )


#: Some of the settings, validated, by name: what one source sets (``@idempotent``, a
#: ``routes`` entry), or what a route's sources set together.
Overrides = Mapping[str, Any]

_CHECKS: dict[str, Callable[[Any, str], object]] = {
    f.name: f.metadata[_CHECK] for f in fields(Settings) if _CHECK in f.metadata
}
#: The settings a route takes by name, and those every call takes.
ROUTE_SETTINGS = frozenset(RouteOptions.__annotations__)
CALL_SETTINGS = frozenset(CallOptions.__annotations__)


def same_names(typed: frozenset[str], checked: Iterable[str]) -> None:
    """Raise ``TypeError`` unless the names the type checkers know (``typed``) are those that
    have a default and a check (``checked``)."""
    if typed != set(checked):
        raise TypeError(
            "RouteOptions and Settings must describe the same settings: "
            f"{sorted(typed ^ set(checked))} in only one of them"
        )


# Once, as the package is imported (not by a test): both name the same settings.
same_names(ROUTE_SETTINGS, _CHECKS)


def overrides(
    given: Mapping[str, object], *, names: frozenset[str] = ROUTE_SETTINGS, where: str = ""
) -> Overrides:
    """The settings ``given`` by name, validated: each value as the setting's check keeps it.
    A name not in ``names`` (the settings this entry takes) raises :class:`ConfigurationError`
    naming it; ``where`` says where they were given (e.g. ``" for route '/x'"``)."""
    unknown = sorted(set(given) - names)
    if unknown:
        raise ConfigurationError(
            f"unknown settings{where}: {unknown} (the settings: {', '.join(sorted(names))})"
        )
    checked: dict[str, Any] = {name: _CHECKS[name](value, name) for name, value in given.items()}
    if "ttl" in checked and "lease" in checked:
        outlives(checked["ttl"], checked["lease"], where)
    return MappingProxyType(checked)


def settings_of(given: Mapping[str, object], *, names: frozenset[str] = ROUTE_SETTINGS) -> Settings:
    """The settings ``given`` by name (validated), the defaults for the others."""
    return Settings(**overrides(given, names=names))


def combined(sources: Sequence[Overrides]) -> Overrides | None:
    """What ``sources``, the most specific first, set together: the first that sets a
    setting wins; ``None`` when there are none."""
    if len(sources) <= 1:
        return sources[0] if sources else None
    merged: dict[str, Any] = {}
    for source in reversed(sources):
        merged.update(source)
    return MappingProxyType(merged)
