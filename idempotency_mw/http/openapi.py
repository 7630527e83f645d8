"""Documents idempotency in a FastAPI application's OpenAPI schema.

Every operation the middleware guards gets the key header (required where a key is required;
the route's own with ``key=from_header(...)``, none with ``key=from_json(...)``), the OASIS
request id and first-sent headers, its key's retention and source (``x-idempotency``:
``retention_seconds``, the route's ``ttl``; ``key_field``, the JSON body's field with the key),
the problem answers the middleware may give instead of the app's, the ``Idempotent-Replayed``
header of replayed responses, the ``Idempotency-Key-Expires`` header of keyed answers and the
``Repeatability-Result`` header of every answer to an OASIS caller; with ``lookup_path``, the
lookup by key is an operation of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from idempotency_mw.http.options import Options
from idempotency_mw.http.policy import RouteTable, app_routes
from idempotency_mw.values.problems import Problem
from idempotency_mw.values.records import KeyState
from idempotency_mw.values.settings import Settings
from idempotency_mw.wire.http import EXPIRES_HEADER, REPLAYED_HEADER, RESULT_HEADER
from idempotency_mw.wire.keys import MAX_KEY_LENGTH

_MARK = "__idempotency_documented__"
_PROBLEM_SCHEMA = "IdempotencyProblem"
_PROBLEM_REF = {"$ref": f"#/components/schemas/{_PROBLEM_SCHEMA}"}


def problem_answers(options: Options) -> dict[int, str]:
    """The statuses of the problem answers the middleware may give, described."""
    answers = {
        400: "Idempotency-Key missing where required, or invalid",
        409: "Key in use by a request still running, reused with a different request, "
        "or its response cannot be replayed",
        412: "Key first sent longer ago than the route keeps keys (Repeatability-First-Sent), "
        "and no record of it: nothing ran",
        413: "Request body too large to fingerprint",
        503: "Idempotency store unavailable, or the key could no longer be held",
    }
    if options.mismatch_status == 422:
        answers[422] = "Key reused with a different request"
    return answers


def document_openapi(app: object, options: Options, routes: RouteTable, prefix: str = "") -> None:
    """Wrap ``app.openapi`` (once) so the schema documents what the middleware does; the same
    for the FastAPI applications mounted in it (under ``prefix``, their mount path).

    Routes added later are documented too: the wrapper reads the routes when the schema is made.
    Applications without an ``openapi`` method (plain Starlette) are left alone.
    """
    for route in getattr(app, "routes", ()):
        mounted = getattr(route, "app", None)
        if hasattr(route, "path") and hasattr(mounted, "openapi"):
            document_openapi(mounted, options, routes, prefix + route.path)
    generate: Callable[[], dict[str, Any]] | None = getattr(app, "openapi", None)
    if generate is None or getattr(generate, _MARK, False):
        return

    def openapi() -> dict[str, Any]:
        schema = generate()
        _document(schema, app, options, routes, prefix)
        return schema

    setattr(openapi, _MARK, True)
    setattr(app, "openapi", openapi)  # noqa: B010  (FastAPI's documented extension point)


def _document(
    schema: dict[str, Any], app: object, options: Options, routes: RouteTable, prefix: str
) -> None:
    paths: dict[str, Any] = schema.get("paths", {})
    guarded = False
    for route in app_routes(app) or ():
        operations = paths.get(route.template, {})
        for method in sorted(options.methods & (route.methods or options.methods)):
            operation = operations.get(method.lower())
            if operation is None:
                continue
            # Policies name the full template, as requests reach it through the mounts.
            policy = routes.policy_for(method, prefix + route.template, route.endpoint)
            settings = options.defaults.merge(policy)
            _document_operation(operation, options, settings)
            ttl = int(settings.ttl) if settings.ttl.is_integer() else settings.ttl
            documented: dict[str, object] = {"retention_seconds": ttl}
            if settings.key is not None and settings.key.in_body:
                documented["key_field"] = settings.key.name
            operation.setdefault("x-idempotency", documented)
            guarded = True
    if options.lookup_path is not None and not prefix:
        paths.setdefault(options.lookup_path + "/{key}", {"get": _lookup_operation()})
    if guarded:
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.setdefault(_PROBLEM_SCHEMA, _problem_schema())


def _document_operation(operation: dict[str, Any], options: Options, settings: Settings) -> None:
    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    source = settings.key
    if source is None or not source.in_body:
        _add_header(
            parameters,
            options.header_name if source is None else source.name,
            required=settings.required,
            description="Unique key of this operation, reused on every retry: a repeat gets "
            "the recorded response instead of running the operation again.",
            schema={"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
        )
    if source is None and options.request_id_header is not None:
        _add_header(
            parameters,
            options.request_id_header,
            required=False,
            description=f"The key as an OASIS Repeatable Requests client sends it (instead of "
            f"{options.header_name}); every answer then says {RESULT_HEADER}.",
            schema={"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
        )
    _add_header(
        parameters,
        options.first_sent_header,
        required=False,
        description="When this operation was first sent (an HTTP-date), on every retry: a "
        "retry older than the key's retention, whose key has no record, is refused with 412 "
        "instead of run again.",
        schema={"type": "string"},
    )
    responses: dict[str, Any] = operation.setdefault("responses", {})
    for code, answer in sorted(problem_answers(options).items()):
        response = responses.setdefault(str(code), {"description": answer})
        response.setdefault("content", {}).setdefault(
            "application/problem+json", {"schema": _PROBLEM_REF}
        )
    for status, response in responses.items():
        if status.startswith("2"):
            response.setdefault("headers", {}).setdefault(
                REPLAYED_HEADER,
                {
                    "description": "`true` when this is the recorded response of an earlier "
                    "request with the same key, replayed.",
                    "schema": {"type": "string", "enum": ["true"]},
                },
            )
        if status.startswith(("2", "409")):
            response.setdefault("headers", {}).setdefault(EXPIRES_HEADER, _EXPIRES)
        if options.request_id_header is not None:
            response.setdefault("headers", {}).setdefault(RESULT_HEADER, _RESULT)


def _add_header(
    parameters: list[dict[str, Any]],
    name: str,
    *,
    required: bool,
    description: str,
    schema: dict[str, Any],
) -> None:
    """Document the header ``name``, unless the operation documents it already."""
    if not any(
        p.get("in") == "header" and str(p.get("name", "")).lower() == name.lower()
        for p in parameters
    ):
        parameters.append(
            {
                "name": name,
                "in": "header",
                "required": required,
                "description": description,
                "schema": schema,
            }
        )


_EXPIRES = {
    "description": "Until when (at least) the key's record is kept: a retry with the key "
    "before then is replayed or refused, never run again.",
    "schema": {"type": "string"},
}


_RESULT = {
    "description": "Sent when the request carried Repeatability-Request-ID: `accepted` when the "
    "key's record holds this request's one execution, `rejected` otherwise.",
    "schema": {"type": "string", "enum": ["accepted", "rejected"]},
}


def _lookup_operation() -> dict[str, Any]:
    return {
        "summary": "Look an operation's outcome up by its key",
        "description": "What became of the caller's key, without sending the request again: "
        "`unknown` (no record: never arrived, or expired), `in-progress` (`lease_until`), "
        "`completed` (`status`, `replayable`) or `committed` (its effect committed, its "
        "answer lost). Another caller's key reads as unknown. `?replay=true` answers the "
        "recorded response itself when there is one.",
        "parameters": [
            {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}},
            {"name": "replay", "in": "query", "required": False, "schema": {"type": "boolean"}},
        ],
        "responses": {
            "200": {
                "description": "The key's state",
                "headers": {EXPIRES_HEADER: _EXPIRES},
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["state"],
                            "properties": {
                                "state": {
                                    "type": "string",
                                    "enum": [state.value for state in KeyState],
                                },
                                "expires_at": {"type": "string", "format": "date-time"},
                                "lease_until": {"type": "string", "format": "date-time"},
                                "status": {"type": ["integer", "null"]},
                                "replayable": {"type": "boolean"},
                            },
                        }
                    }
                },
            }
        },
    }


def _problem_schema() -> dict[str, Any]:
    return {
        "title": "Idempotency problem (RFC 9457)",
        "type": "object",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string", "enum": sorted(p.type_uri for p in Problem)},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
    }
