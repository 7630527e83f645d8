"""Documents the idempotency key header in a FastAPI application's OpenAPI schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from idempotency_mw.policy import RouteTable, Settings

_MARK = "__idempotency_documented__"


def document_key_header(
    app: object, header_name: str, methods: frozenset[str], defaults: Settings, table: RouteTable
) -> None:
    """Wrap ``app.openapi`` so every operation the middleware guards lists the key header.

    The header is required where the effective settings require a key. Applications without
    an ``openapi`` method (plain Starlette) are left alone.
    """
    generate: Callable[[], dict[str, Any]] | None = getattr(app, "openapi", None)
    if generate is None or getattr(generate, _MARK, False):
        return

    def openapi() -> dict[str, Any]:
        schema = generate()
        paths: dict[str, Any] = schema.get("paths", {})
        for route in getattr(app, "routes", ()):
            operations = paths.get(getattr(route, "path_format", ""), {})
            for method in sorted(methods & set(getattr(route, "methods", None) or ())):
                operation = operations.get(method.lower())
                if operation is None:
                    continue
                settings = defaults.merge(table.policy_for(route.path, route.endpoint))
                _add_header(operation, header_name, required=settings.required)
        return schema

    setattr(openapi, _MARK, True)
    setattr(app, "openapi", openapi)  # noqa: B010  (FastAPI's documented extension point)


def _add_header(operation: dict[str, Any], header_name: str, *, required: bool) -> None:
    parameters: list[dict[str, Any]] = operation.setdefault("parameters", [])
    if any(
        p.get("in") == "header" and str(p.get("name", "")).lower() == header_name.lower()
        for p in parameters
    ):
        return
    parameters.append(
        {
            "name": header_name,
            "in": "header",
            "required": required,
            "description": (
                "Unique key of this operation, reused on every retry: a repeat gets the "
                "recorded response instead of running the operation again."
            ),
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        }
    )
