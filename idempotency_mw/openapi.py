"""Documents idempotency in a FastAPI application's OpenAPI schema.

Every operation the middleware guards gets the key header (required where a key is required),
the problem answers the middleware may give instead of the app's, and the ``Idempotent-Replayed``
header of replayed responses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from idempotency_mw.options import Options
from idempotency_mw.policy import RouteTable, app_routes
from idempotency_mw.problems import Problem

_MARK = "__idempotency_documented__"
_PROBLEM_SCHEMA = "IdempotencyProblem"
_PROBLEM_REF = {"$ref": f"#/components/schemas/{_PROBLEM_SCHEMA}"}


def problem_answers(options: Options) -> dict[int, str]:
    """The statuses of the problem answers the middleware may give, described."""
    answers = {
        400: "Idempotency-Key missing where required, or invalid",
        409: "Key in use by a request still running, reused with a different request, "
        "or its response cannot be replayed",
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
            _document_operation(
                operation, options, required=options.defaults.merge(policy).required
            )
            guarded = True
    if guarded:
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.setdefault(_PROBLEM_SCHEMA, _problem_schema())


def _document_operation(operation: dict[str, Any], options: Options, *, required: bool) -> None:
    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    name = options.header_name
    if not any(
        p.get("in") == "header" and str(p.get("name", "")).lower() == name.lower()
        for p in parameters
    ):
        parameters.append(
            {
                "name": name,
                "in": "header",
                "required": required,
                "description": (
                    "Unique key of this operation, reused on every retry: a repeat gets the "
                    "recorded response instead of running the operation again."
                ),
                "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            }
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
                "Idempotent-Replayed",
                {
                    "description": "`true` when this is the recorded response of an earlier "
                    "request with the same key, replayed.",
                    "schema": {"type": "string", "enum": ["true"]},
                },
            )


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
