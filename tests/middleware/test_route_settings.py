"""The per-route settings are declared once (:class:`RoutePolicy`, with each one's validation);
what names them again agrees with it, and validates as it does."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any, cast

import pytest
from fastapi import FastAPI

from idempotency_mw import ConfigurationError, IdempotencyMiddleware, RouteOptions, idempotent
from idempotency_mw.options import build_options
from idempotency_mw.policy import RoutePolicy, Settings
from idempotency_mw.testing import MemoryStore

POLICY = {f.name for f in fields(RoutePolicy)}
#: Set by the decorator's scope=, never given by name.
DERIVED = {"scoped"}


def keywords(function: Any) -> set[str]:
    return {
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY
    }


def test_every_place_names_the_same_settings() -> None:
    assert {f.name for f in fields(Settings)} == POLICY
    assert set(RouteOptions.__annotations__) == POLICY - DERIVED
    assert keywords(idempotent) == POLICY - DERIVED | {"scope"}
    assert keywords(IdempotencyMiddleware) >= POLICY - DERIVED
    # build_options takes them as route_defaults, validated by RoutePolicy: no second list.
    assert not (POLICY & keywords(build_options))


BAD = [
    ("ttl", 0, "ttl must be a positive duration"),
    ("lease", -1, "lease must be a positive duration"),
    ("wait", -1, "wait must be a positive duration"),
    ("release_statuses", [500], "release_statuses must be 4xx statuses"),
    ("fingerprint", "xml", "fingerprint must be 'bytes' or 'json'"),
    ("fenced", "yes", "fenced must be True or False"),
    ("max_request_bytes", -1, "max_request_bytes must be a number of bytes"),
    ("max_request_bytes", "1MB", "max_request_bytes must be a number of bytes"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_a_bad_setting_is_refused_alike_everywhere(name: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        idempotent(**{name: value})
    # A setting named at run time, as a route table read from a file gives it.
    route = cast(RouteOptions, {name: value})
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), routes={"/x": route})
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), **{name: value})


def test_an_unknown_route_setting_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown options for route '/x'"):
        IdempotencyMiddleware(FastAPI(), store=MemoryStore(), routes={"/x": {"fenceed": True}})  # type: ignore[typeddict-unknown-key]


def test_a_policy_overrides_only_what_it_sets() -> None:
    defaults = IdempotencyMiddleware(FastAPI(), store=MemoryStore(), ttl=60, wait=1).options
    merged = defaults.defaults.merge(RoutePolicy.of({"ttl": 5, "release_statuses": [409]}))
    assert (merged.ttl, merged.wait, merged.release_statuses) == (5.0, 1.0, frozenset({409}))
    assert merged.lease == defaults.defaults.lease == 60.0
    assert defaults.defaults.merge(None) is defaults.defaults
