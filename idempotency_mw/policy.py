"""Per-route settings: the ``@idempotent`` decorator, a settings mapping, and route resolution."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypedDict, TypeVar

from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from idempotency_mw.exceptions import ConfigurationError

_POLICY_ATTRIBUTE = "__idempotency_policy__"

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])
Duration = float | timedelta


def to_seconds(value: Duration, name: str) -> float:
    """Seconds from a number or a timedelta; anything not positive is a configuration error."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ConfigurationError(f"{name} must be a positive duration, got {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Settings of one route; ``None`` means "the middleware's default"."""

    ttl: float | None = None
    required: bool | None = None
    lease: float | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings that apply to one request, all resolved."""

    ttl: float
    required: bool
    lease: float

    def merge(self, policy: RoutePolicy | None) -> Settings:
        """These settings overridden by whatever ``policy`` sets."""
        if policy is None:
            return self
        return Settings(
            ttl=self.ttl if policy.ttl is None else policy.ttl,
            required=self.required if policy.required is None else policy.required,
            lease=self.lease if policy.lease is None else policy.lease,
        )


class RouteOptions(TypedDict, total=False):
    """Keyword options of :func:`idempotent`, as values of the middleware's ``routes`` mapping."""

    ttl: Duration
    required: bool
    lease: Duration


def make_policy(
    ttl: Duration | None = None, required: bool | None = None, lease: Duration | None = None
) -> RoutePolicy:
    """A validated :class:`RoutePolicy`."""
    return RoutePolicy(
        ttl=None if ttl is None else to_seconds(ttl, "ttl"),
        required=required,
        lease=None if lease is None else to_seconds(lease, "lease"),
    )


def idempotent(
    *, ttl: Duration | None = None, required: bool | None = None, lease: Duration | None = None
) -> Callable[[Endpoint], Endpoint]:
    """Per-route settings for the endpoint it decorates; the endpoint itself is unchanged.

    ``ttl``: how long a completed response is replayed (seconds or timedelta);
    ``required``: whether requests without a key are rejected with 400;
    ``lease``: how long an in-progress claim is honoured before a retry may take it over.
    """
    policy = make_policy(ttl, required, lease)

    def decorate(endpoint: Endpoint) -> Endpoint:
        setattr(endpoint, _POLICY_ATTRIBUTE, policy)
        return endpoint

    return decorate


class RouteTable:
    """Finds a request's route template and the policy that applies to it."""

    def __init__(self, routes: Mapping[str, RouteOptions] | None) -> None:
        self._exact: dict[str, RoutePolicy] = {}
        self._patterns: list[tuple[str, RoutePolicy]] = []
        for pattern, options in (routes or {}).items():
            unknown = set(options) - set(RouteOptions.__annotations__)
            if unknown:
                raise ConfigurationError(
                    f"unknown options for route {pattern!r}: {sorted(unknown)}"
                )
            policy = make_policy(**options)
            if any(char in pattern for char in "*?["):
                self._patterns.append((pattern, policy))
            else:
                self._exact[pattern] = policy

    def resolve(self, scope: Scope) -> tuple[str, RoutePolicy | None]:
        """The request's route template (its path when no route matches) and its policy."""
        template, endpoint = _match_route(scope)
        return template, self.policy_for(template, endpoint)

    def policy_for(self, template: str, endpoint: object) -> RoutePolicy | None:
        """A decorated endpoint's policy, else the mapping's (exact entries before patterns)."""
        decorated: RoutePolicy | None = getattr(endpoint, _POLICY_ATTRIBUTE, None)
        if decorated is not None:
            return decorated
        policy = self._exact.get(template)
        if policy is not None:
            return policy
        return next(
            (p for pattern, p in self._patterns if fnmatch.fnmatchcase(template, pattern)), None
        )


def _match_route(scope: Scope) -> tuple[str, object]:
    router = getattr(scope.get("app"), "router", None)
    routes: list[BaseRoute] | None = getattr(router, "routes", None)
    found = _match_in(routes, scope) if routes is not None else None
    return found if found is not None else (scope["path"], None)


def _match_in(routes: list[BaseRoute], scope: Scope) -> tuple[str, object] | None:
    partial: tuple[str, object] | None = None
    for route in routes:
        match, child_scope = route.matches(scope)
        if match is Match.NONE:
            continue
        prefix = getattr(route, "path", "")
        children: list[BaseRoute] | None = getattr(route, "routes", None)
        if children:
            inner = _match_in(children, {**scope, **child_scope})
            if inner is None:
                continue
            found = (prefix + inner[0], inner[1])
        elif hasattr(route, "endpoint"):
            found = (prefix, route.endpoint)
        else:
            # A mounted ASGI app without routes: its full path stands for the template.
            found = (scope["path"], None)
        if match is Match.FULL:
            return found
        # A route that matches the path but not the method answers 405: its template counts,
        # its endpoint's settings do not.
        partial = partial or (found[0], None)
    return partial
