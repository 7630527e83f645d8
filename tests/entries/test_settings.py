"""The settings are described once (:mod:`idempotency_mw.values.settings`): every entry takes
them by name and validates them with the same check, and refuses a name that is not one of its
settings."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import pytest
from fastapi import FastAPI

from idempotency_mw import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotentFunctions,
    RouteOptions,
    idempotent,
    install,
)
from idempotency_mw.mcp import IdempotentTools
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.settings import (
    CALL_SETTINGS,
    Settings,
    combined,
    overrides,
    same_names,
    settings_of,
)

Entry = Callable[[dict[str, Any]], object]

#: Every way a user gives settings by name; the last two take only those of every call.
ROUTE_ENTRIES: dict[str, Entry] = {
    "middleware": lambda given: IdempotencyMiddleware(FastAPI(), store=MemoryStore(), **given),
    "install": lambda given: install(FastAPI(), store=MemoryStore(), **given),
    "@idempotent": lambda given: idempotent(**given),
    "routes=": lambda given: IdempotencyMiddleware(
        FastAPI(), store=MemoryStore(), routes={"/x": cast(RouteOptions, given)}
    ),
}
CALL_ENTRIES: dict[str, Entry] = {
    "functions": lambda given: IdempotentFunctions(MemoryStore(), **given),
    "MCP tools": lambda given: IdempotentTools(MemoryStore(), **given),
}
ENTRIES = {**ROUTE_ENTRIES, **CALL_ENTRIES}

BAD: list[tuple[str, object]] = [
    ("ttl", 0),
    ("ttl", "60"),
    ("ttl", None),
    ("lease", -1),
    ("lease", timedelta(0)),
    ("wait", -1),
    ("wait", True),
    ("required", "yes"),
    ("release_statuses", [500]),
    ("release_statuses", 409),
    ("release_statuses", "409"),
    ("fingerprint", "xml"),
    ("fenced", "yes"),
    ("max_request_bytes", -1),
    ("max_request_bytes", "1MB"),
    ("key", "webhook-id"),
]


def bad_cases() -> list[Any]:
    return [
        pytest.param(entry, name, value, id=f"{entry}-{name}={value!r}")
        for name, value in BAD
        for entry in (ENTRIES if name in CALL_SETTINGS else ROUTE_ENTRIES)
    ]


@pytest.mark.parametrize(("entry", "name", "value"), bad_cases())
def test_a_wrong_value_is_refused_by_every_entry_with_the_one_check(
    entry: str, name: str, value: object
) -> None:
    with pytest.raises(ConfigurationError) as the_check:
        overrides({name: value})
    with pytest.raises(ConfigurationError) as refused:
        ENTRIES[entry]({name: value})
    assert str(refused.value) == str(the_check.value)
    assert str(refused.value).startswith(f"{name} must be ")


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_unknown_name_is_refused_by_every_entry_naming_it(entry: str) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown settings.*\['fenceed'\]"):
        ENTRIES[entry]({"fenceed": True, "ttl": 5})


@pytest.mark.parametrize("entry", CALL_ENTRIES)
@pytest.mark.parametrize("name", ["required", "release_statuses", "max_request_bytes", "key"])
def test_a_route_setting_given_to_a_call_entry_is_refused_naming_it(entry: str, name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"unknown settings: \['{name}'\]"):
        CALL_ENTRIES[entry]({name: getattr(Settings(), name)})


def test_an_unknown_name_in_a_routes_entry_names_the_entry() -> None:
    routes: dict[str, Any] = {"/x": {"ttl": 5}, "DELETE /x": {"tll": 5}}
    with pytest.raises(ConfigurationError, match=r"settings for route 'DELETE /x': \['tll'\]"):
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), routes=routes)


def test_the_values_given_are_kept_as_the_check_makes_them() -> None:
    given: dict[str, Any] = {"ttl": timedelta(minutes=2), "lease": 7, "wait": 0}
    functions = IdempotentFunctions(MemoryStore(), **given)
    tools = IdempotentTools(MemoryStore(), **given)
    middleware = IdempotencyMiddleware(
        FastAPI(), store=MemoryStore(), release_statuses=[409, 409], **given
    )
    kept = settings_of({**given, "release_statuses": [409, 409]})
    assert (kept.ttl, kept.lease, kept.wait) == (120.0, 7.0, 0.0)
    assert kept.release_statuses == frozenset({409})
    assert functions.settings == tools.functions.settings == settings_of(given)
    assert middleware.options.defaults == kept
    # What no one sets is the same default everywhere.
    assert IdempotentFunctions(MemoryStore()).settings == Settings()
    assert IdempotencyMiddleware(FastAPI(), store=MemoryStore()).options.defaults == Settings()


def test_a_route_overrides_only_what_its_sources_set_the_most_specific_first() -> None:
    defaults = settings_of({"ttl": 600, "wait": 1, "lease": 2})
    route = combined([overrides({"ttl": 5}), overrides({"ttl": 9, "release_statuses": [409]})])
    merged = defaults.merge(route)
    assert (merged.ttl, merged.wait, merged.release_statuses) == (5.0, 1.0, frozenset({409}))
    assert merged.lease == defaults.lease == 2
    assert defaults.merge(None) is defaults
    assert combined([]) is None


def test_the_typed_names_and_the_checked_settings_must_agree() -> None:
    # Run once at import on the real descriptions; here on two that differ.
    with pytest.raises(TypeError, match=r"\['fenced'\] in only one of them"):
        same_names(frozenset({"ttl"}), ["ttl", "fenced"])


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_ttl_not_longer_than_its_lease_is_refused_by_every_entry(entry: str) -> None:
    with pytest.raises(ConfigurationError, match="ttl must be longer than lease"):
        ENTRIES[entry]({"ttl": 30, "lease": 30})


@pytest.mark.parametrize("entry", ["middleware", "install", *CALL_ENTRIES])
def test_a_ttl_within_the_default_lease_is_refused(entry: str) -> None:
    with pytest.raises(ConfigurationError, match="got ttl=30 s and lease=60 s"):
        ENTRIES[entry]({"ttl": 30})


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["@idempotent", "routes="])
async def test_a_routes_ttl_within_the_middlewares_lease_fails_the_start_up(where: str) -> None:
    from asgi_lifespan import LifespanManager

    app = FastAPI()
    routes: dict[str, RouteOptions] = {"/x": {"ttl": 30}} if where == "routes=" else {}
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), lease=60, routes=routes)

    @app.post("/x")
    @idempotent(**cast(RouteOptions, {"ttl": 30} if where == "@idempotent" else {}))
    async def x() -> None: ...

    with pytest.raises(ConfigurationError, match=r"route 'POST /x': ttl must be longer than"):
        async with LifespanManager(app):
            pass
