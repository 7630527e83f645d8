"""Per-route settings: ``@idempotent``, the ``routes`` mapping, and resolving a request's route.

A request's route is found the way the app will find it: included routers (flattened, as FastAPI
dispatches them), mounted sub-applications and host routes (decided inside, with no fall-through),
path converters and methods. A request the app would answer 404 or 405 resolves to nothing: it is
not ours to guard or record.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar, Unpack, cast

from starlette.routing import Match, Router
from starlette.types import Scope

from idempotency_mw.door import with_scope_dependency
from idempotency_mw.exceptions import ConfigurationError
from idempotency_mw.settings import Overrides, RouteOptions, combined, overrides

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
    ``max_request_bytes``): what they set overrides the middleware's defaults and the
    ``routes`` mapping.
    ``scope``: a FastAPI dependency (``Depends(current_user)``) whose value, a non-empty
    string, is the caller's scope of this route's keys; its own errors (a 401) are the app's
    answers, given before any key is claimed. The endpoint is then wrapped, so that FastAPI
    resolves the dependency with the endpoint's others.
    """
    policy = overrides(options, where=" of @idempotent")
    if scope is not None:
        policy = MappingProxyType({**policy, "scoped": True})

    def decorate(endpoint: Endpoint) -> Endpoint:
        if scope is not None:
            endpoint = cast(Endpoint, with_scope_dependency(endpoint, scope))
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
    """A request's route: its full template and the policy that applies to it."""

    template: str
    #: The settings the route's sources set (``None``: the middleware's defaults).
    policy: Overrides | None
    #: The route object the app dispatches to (``None`` where the app's routes are opaque).
    route: object = None


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
        found = _resolve_in(tree.nodes, scope)
        resolved = (
            None
            if found is None
            else Resolved(
                found[0],
                self.policy_for(scope["method"], found[0], getattr(found[1], "endpoint", None)),
                found[1],
            )
        )
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[cache_key] = resolved
        return resolved

    def _current_tree(self, app: object) -> _Tree | None:
        routes = _routes_of(app)
        if routes is None:
            return None
        # Rebuilt when the app's route list is replaced or grows (routes added after start-up).
        version = (id(routes), len(routes))
        if self._tree is None or self._tree.version != version:
            nodes = _build(routes)
            self._tree = _Tree(version, nodes, any(_has_hosts(node) for node in nodes))
            self._cache.clear()
        return self._tree


def app_routes(app: object) -> list[RouteInfo] | None:
    """Every HTTP endpoint of ``app`` with its full template (``None`` for an app whose routes
    cannot be read: not Starlette's)."""
    routes = _routes_of(app)
    return None if routes is None else list(_leaves(_build(routes), ""))


@dataclass(frozen=True, slots=True)
class _Node:
    """A route as the app dispatches it: a leaf (an endpoint) or a branch (mount, host)."""

    route: Any
    template: str
    endpoint: object = None
    #: A mount's or host's routes, decided inside it; ``None`` for a leaf or an opaque app.
    children: list[_Node] | None = None
    is_branch: bool = False
    is_host: bool = False


@dataclass(frozen=True, slots=True)
class _Tree:
    version: tuple[int, int]
    nodes: list[_Node]
    #: Whether a host route decides: only then does the Host header enter the cache key.
    has_hosts: bool


def _routes_of(app: object) -> Sequence[Any] | None:
    """The routes of a Starlette (or FastAPI) app or router; ``None`` for any other app
    (Litestar's routes, say, are not dispatched the way this module reads them)."""
    router = getattr(app, "router", app)
    if not isinstance(router, Router):
        return None
    return router.routes


def _build(routes: Sequence[Any]) -> list[_Node]:
    nodes: list[_Node] = []
    for route in _effective(routes):
        children = getattr(route, "routes", None)
        if hasattr(route, "endpoint") and children is None:
            template = getattr(route, "path_format", None) or getattr(route, "path", "")
            nodes.append(_Node(route, str(template), route.endpoint))
        elif hasattr(route, "matches"):
            # A Mount (its path is the prefix) or a Host (no path); an app mounted without
            # routes this module can read is opaque: any path under it is guarded.
            prefix = getattr(route, "path", "")
            inner_routes = _routes_of(getattr(route, "app", None))
            inner = _build(inner_routes) if inner_routes else None
            nodes.append(
                _Node(
                    route,
                    prefix,
                    children=inner,
                    is_branch=True,
                    is_host=hasattr(route, "host"),
                )
            )
    return nodes


def _effective(routes: Sequence[Any]) -> Iterator[Any]:
    """``routes`` with FastAPI's included routers flattened into the routes they dispatch to.

    FastAPI up to 0.16x copied an included router's routes, prefixed, into the app's list; newer
    versions keep an included-router object that dispatches through effective route contexts.
    """
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is None:
            yield route
            continue
        for context in contexts():
            starlette_route = getattr(context, "starlette_route", None)
            yield starlette_route if starlette_route is not None else context


def _resolve_in(nodes: list[_Node], scope: Scope) -> tuple[str, object] | None:
    """The full template and the route object (``None`` inside an opaque mount)."""
    """Like Starlette's router: the first full match wins; a path match alone means 405."""
    for node in nodes:
        match, child_scope = node.route.matches(scope)
        if match is Match.NONE:
            continue
        if node.is_branch:
            # A mount or host that matches handles the request whatever happens inside it.
            if node.children is None:
                return scope["path"], None
            inner = _resolve_in(node.children, {**scope, **child_scope})
            return None if inner is None else (node.template + inner[0], inner[1])
        if match is Match.FULL:
            return node.template, node.route
        # PARTIAL: the path is a route's but not the method; unless a later route takes the
        # method, the app answers 405, which is not ours to guard.
    return None


def _leaves(nodes: list[_Node], prefix: str) -> Iterator[RouteInfo]:
    for node in nodes:
        if node.is_branch:
            if node.children is not None:
                yield from _leaves(node.children, prefix + node.template)
            continue
        if not hasattr(node.route, "methods"):
            continue  # a websocket route
        methods = node.route.methods
        yield RouteInfo(
            prefix + node.template, None if methods is None else frozenset(methods), node.endpoint
        )


def _has_hosts(node: _Node) -> bool:
    return node.is_host or any(_has_hosts(child) for child in node.children or ())


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
