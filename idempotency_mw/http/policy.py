"""Per-route settings: ``@idempotent``, the ``routes`` mapping, and resolving a request's route.

A request's route is found the way the app will find it, through each route's own
``matches(scope)``: included routers (FastAPI's ``iter_route_contexts`` opens them), mounted
sub-applications and host routes (decided inside, with no fall-through, through their
``routes``), path converters and methods. A request the app would answer 404 or 405 resolves to
nothing: it is not ours to guard or record.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar, Unpack, cast

from starlette.routing import BaseRoute, Match, Router, WebSocketRoute
from starlette.types import Scope

from idempotency_mw.http.door import doors_of, endpoint_door
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.settings import Overrides, RouteOptions, Settings, combined, overrides

_POLICY_ATTRIBUTE = "__idempotency_policy__"
#: Resolutions kept per middleware; paths with ids in them would otherwise grow it without end.
_CACHE_SIZE = 2048

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


def idempotent(
    *, scope: object = None, **options: Unpack[RouteOptions]
) -> Callable[[Endpoint], Endpoint]:
    """Per-route settings for the endpoint it decorates (put it below the route decorator).

    ``options`` are the route's settings (:class:`~idempotency_mw.RouteOptions`: ``ttl``,
    ``required``, ``lease``, ``release_statuses``, ``fingerprint``, ``wait``, ``fenced``,
    ``max_request_bytes``, ``key``): what they set overrides the middleware's defaults and the
    ``routes`` mapping.
    ``scope``: a FastAPI dependency (``Depends(current_user)``) whose value, a non-empty
    string, is the caller's scope of this route's keys; its own errors (a 401) are the app's
    answers, given before any key is claimed.

    The endpoint is wrapped in its door (see :mod:`idempotency_mw.http.door`), before the route is
    made of it: a request refused before the endpoint runs (FastAPI's validation, a
    dependency's ``HTTPException``) releases its key instead of recording the answer.
    """
    policy = overrides(options, where=" of @idempotent")
    if scope is not None:
        policy = MappingProxyType({**policy, "scoped": True})

    def decorate(endpoint: Endpoint) -> Endpoint:
        endpoint = cast(Endpoint, endpoint_door(endpoint, scope))
        setattr(endpoint, _POLICY_ATTRIBUTE, policy)
        return endpoint

    return decorate


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """One endpoint of the app as a request reaches it: full path template, methods, endpoint."""

    template: str
    methods: frozenset[str] | None
    endpoint: object


@dataclass(frozen=True, slots=True)
class Resolved:
    """A request's route: its full template, the policy that applies to it, its door."""

    template: str
    #: The settings the route's sources set (``None``: the middleware's defaults).
    policy: Overrides | None
    #: Which door the route has (see :func:`~idempotency_mw.http.door.doors_of`; ``None`` where the
    #: app's routes cannot be read).
    doors: str | None = None


class RouteTable:
    """The ``routes`` mapping, and the resolution of requests against an app's routes.

    Keys of ``routes`` are a path template (``/orders/{id}``), a glob over templates
    (``/v1/*``), or either after a method (``DELETE /orders/{id}``); an entry with a method wins
    over one without, an exact template over a glob, and a decorated endpoint over the mapping.
    """

    def __init__(self, routes: Mapping[str, RouteOptions] | None) -> None:
        self._exact: dict[tuple[str | None, str], Overrides] = {}
        self._patterns: list[tuple[str | None, str, Overrides]] = []
        for entry, options in (routes or {}).items():
            method, template = _split_entry(entry)
            policy = overrides(options, where=f" for route {entry!r}")
            if any(char in template for char in "*?["):
                self._patterns.append((method, template, policy))
            else:
                self._exact[method, template] = policy
        self._tree: _Tree | None = None
        self._cache: dict[tuple[str, str, str, str], Resolved | None] = {}

    def policy_for(self, method: str, template: str, endpoint: object) -> Overrides | None:
        """The route's settings, each from the most specific source that sets it: the
        decorator, then an exact entry with the method, without it, then globs (those with
        the method first, each kind in the order given)."""
        sources: list[Overrides] = []
        decorated: Overrides | None = getattr(endpoint, _POLICY_ATTRIBUTE, None)
        if decorated is not None:
            sources.append(decorated)
        sources += [
            self._exact[key] for key in ((method, template), (None, template)) if key in self._exact
        ]
        matching = [
            (pattern_method, policy)
            for pattern_method, pattern, policy in self._patterns
            if pattern_method in (None, method) and fnmatch.fnmatchcase(template, pattern)
        ]
        sources += [p for m, p in matching if m is not None]
        sources += [p for m, p in matching if m is None]
        return combined(sources)

    def check(self, routes: Sequence[RouteInfo], defaults: Settings) -> None:
        """Raise :class:`ConfigurationError` for a route of ``routes`` whose settings, over
        ``defaults``, do not hold together (a ``ttl`` not longer than its ``lease``)."""
        for route in routes:
            for method in sorted(route.methods or {None}, key=str):
                policy = self.policy_for(method or "", route.template, route.endpoint)
                try:
                    defaults.merge(policy)
                except ConfigurationError as exc:
                    name = _entry_name(method, route.template)
                    raise ConfigurationError(f"route {name!r}: {exc}") from exc

    def unmatched_entries(self, routes: Sequence[RouteInfo]) -> list[str]:
        """Entries of the mapping that name no route of the app (reported at start-up)."""
        found: list[str] = []
        for method, template in self._exact:
            if not any(_covers(method, route) and route.template == template for route in routes):
                found.append(_entry_name(method, template))
        for method, pattern, _ in self._patterns:
            if not any(
                _covers(method, route) and fnmatch.fnmatchcase(route.template, pattern)
                for route in routes
            ):
                found.append(_entry_name(method, pattern))
        return found

    def resolve(self, app: object, scope: Scope) -> Resolved | None:
        """The request's route and policy, or ``None`` when the app would answer 404 or 405."""
        tree = self._current_tree(app)
        if tree is None:
            # Not a Starlette app (a bare ASGI callable): every path is a route of its own.
            return Resolved(scope["path"], self.policy_for(scope["method"], scope["path"], None))
        cache_key = (
            scope["method"],
            scope.get("root_path", ""),
            scope["path"],
            _host(scope) if tree.has_hosts else "",
        )
        try:
            return self._cache[cache_key]
        except KeyError:
            pass
        found = _match(tree.routes, scope)
        resolved = None
        if found is not None:
            template, route = found
            endpoint = None if route is None else route.endpoint
            doors = None if route is None else route.doors
            resolved = Resolved(
                template, self.policy_for(scope["method"], template, endpoint), doors
            )
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[cache_key] = resolved
        return resolved

    def forget(self) -> None:
        """Read the app's routes again at the next request (they just got their doors)."""
        self._tree = None

    def _current_tree(self, app: object) -> _Tree | None:
        routes = _routes_of(app)
        if routes is None:
            return None
        # Rebuilt when the app's route list is replaced or grows (routes added after start-up).
        version = (id(routes), len(routes))
        if self._tree is None or self._tree.version != version:
            tree = _read(routes)
            self._tree = _Tree(version, tree, _has_hosts(tree))
            self._cache.clear()
        return self._tree


def app_routes(app: object) -> list[RouteInfo] | None:
    """Every HTTP endpoint of ``app`` with its full template (``None`` for an app whose routes
    cannot be read: not Starlette's)."""
    routes = _routes_of(app)
    return None if routes is None else list(_leaves(_read(routes), ""))


def routes_within(app: object) -> Iterator[Any]:
    """Every route object ``app`` holds in its route lists and in those of its mounted apps and
    host routes (not the ones FastAPI makes itself, at dispatch, for included routers)."""
    routes = _routes_of(app)
    if routes is not None:
        yield from _within(routes)


@dataclass(frozen=True, slots=True)
class _Route:
    """A route as its router tries it, read once (through FastAPI's route contexts every
    attribute is a lookup of its own): an endpoint's, or a mount or a host with its own."""

    matches: Callable[[Scope], tuple[Match, Scope]]
    #: An endpoint's route's template, a mount's path ("" for a host).
    template: str
    #: A mount's or a host's routes (``[]``: they cannot be read); ``None``: an endpoint's route.
    routes: list[_Route] | None = None
    endpoint: object = None
    methods: frozenset[str] | None = None
    doors: str | None = None
    host: bool = False


@dataclass(frozen=True, slots=True)
class _Tree:
    version: tuple[int, int]
    routes: list[_Route]
    #: Whether a host route decides: only then does the Host header enter the cache key.
    has_hosts: bool


def _routes_of(app: object) -> Sequence[Any] | None:
    """The routes of a Starlette (or FastAPI) app or router; ``None`` for any other app
    (Litestar's routes, say, are not dispatched the way this module reads them)."""
    router = getattr(app, "router", app)
    if not isinstance(router, Router):
        return None
    return router.routes


def _readable(routes: Sequence[Any]) -> bool:
    """Whether a mount's or host's ``routes`` are a router's, which this module can follow."""
    return bool(routes) and all(isinstance(route, BaseRoute) for route in routes)


def _read(routes: Sequence[Any]) -> list[_Route]:
    read: list[_Route] = []
    for route in _dispatched(routes):
        inner = getattr(route, "routes", None)
        template = getattr(route, "path_format", None)
        if isinstance(getattr(route, "route", route), WebSocketRoute):
            continue  # FastAPI's route contexts stand for the route they name (.route)
        if inner is None and template is not None:
            methods = getattr(route, "methods", None)
            read.append(
                _Route(
                    route.matches,
                    template,
                    endpoint=getattr(route, "endpoint", None),
                    methods=None if methods is None else frozenset(methods),
                    doors=doors_of(route),
                )
            )
        else:
            # A mount or a host; one whose routes cannot be read, like a route that names no
            # template, is guarded by its paths.
            within = _read(inner) if inner is not None and _readable(inner) else []
            path = getattr(route, "path", None) or ""
            read.append(_Route(route.matches, path, within, host=hasattr(route, "host")))
    return read


def _dispatched(routes: Sequence[Any]) -> Sequence[Any]:
    """``routes`` in the order their router tries them. FastAPI (from 0.137.2) keeps an included
    router as one entry, which its ``iter_route_contexts`` opens into the routes it dispatches
    to, prefixed; other routers' lists (FastAPI's before 0.137) hold those routes already."""
    # An app of FastAPI's has imported it; a Starlette app does not need to.
    contexts = getattr(sys.modules.get("fastapi.routing"), "iter_route_contexts", None)
    return routes if contexts is None else list(contexts(routes))


def _within(routes: Sequence[Any]) -> Iterator[Any]:
    for route in routes:
        yield route
        inner = getattr(route, "routes", None)
        if inner is not None and _readable(inner):
            yield from _within(inner)


def _match(routes: list[_Route], scope: Scope) -> tuple[str, _Route | None] | None:
    """The full template of the route the app dispatches ``scope`` to, and that route (``None``
    where the app's routes cannot be read: any path there is guarded); ``None`` when the app
    answers 404 or 405. As its router: the first route that matches fully wins; a mount or a
    host that matches decides, whatever happens inside it."""
    for route in routes:
        match, child_scope = route.matches(scope)
        if match is Match.NONE:
            continue
        if route.routes == []:
            return scope["path"], None  # guarded by its paths
        if route.routes is not None:
            found = _match(route.routes, {**scope, **child_scope})
            return None if found is None else (route.template + found[0], found[1])
        if match is Match.FULL:
            return route.template, route
        # PARTIAL: the path is a route's but not the method; unless a later route takes the
        # method, the app answers 405, which is not ours to guard.
    return None


def _leaves(routes: list[_Route], prefix: str) -> Iterator[RouteInfo]:
    for route in routes:
        if route.routes is not None:
            yield from _leaves(route.routes, prefix + route.template)
        else:
            yield RouteInfo(prefix + route.template, route.methods, route.endpoint)


def _has_hosts(routes: list[_Route]) -> bool:
    return any(route.host or _has_hosts(route.routes or []) for route in routes)


def _host(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return str(value.decode("latin-1"))
    return ""


def _split_entry(entry: str) -> tuple[str | None, str]:
    method, space, template = entry.partition(" ")
    if not space:
        return None, entry
    if not method.isalpha() or not template.startswith(("/", "*")):
        raise ConfigurationError(
            f"route entry {entry!r} must be a template or a method and a template, "
            "e.g. 'DELETE /orders/{id}'"
        )
    return method.upper(), template.strip()


def _covers(method: str | None, route: RouteInfo) -> bool:
    return method is None or route.methods is None or method in route.methods


def _entry_name(method: str | None, template: str) -> str:
    return template if method is None else f"{method} {template}"
