"""MCP tool calls once per key: an extension of the ``mcp`` SDK's ``MCPServer``.

A ``tools/call`` whose ``params._meta["idempotencyKey"]`` is set runs through
:class:`~idempotency_mw.functions.IdempotentFunctions` on its key, fingerprinted by the tool's
name and arguments (never the JSON-RPC id or the session). The tool's ``CallToolResult`` is
recorded, not the bytes that carried it, so a retry (a new id, the same session or another,
any transport) gets it framed for its own request. Calls without a key, and every other
method, are untouched. Needs the ``[mcp]`` extra.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from datetime import timedelta
from typing import Any, cast

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolRequestParams, CallToolResult

from idempotency_mw.exceptions import IdempotencyError, LeaseLost, StoreError
from idempotency_mw.fence import UNKEYED, current_claim
from idempotency_mw.functions import (
    CommittedWithoutResult,
    IdempotentFunctions,
    KeyReused,
    ResultNotReplayable,
    StillRunning,
)
from idempotency_mw.metrics import EventHook
from idempotency_mw.policy import Duration
from idempotency_mw.problems import RETRYABLE, Problem
from idempotency_mw.stores.base import Store

#: Where a call carries its key: ``params._meta[META_KEY]`` (the client's, too).
META_KEY = "idempotencyKey"
#: The JSON-RPC error code of every refusal; ``data`` is the problem (its ``type`` says which,
#: as in the middleware's problem+json answers).
IDEMPOTENCY_ERROR = -32030
#: What a protected tool's ``_meta`` says, so that an agent can tell it from another.
TOOL_META: dict[str, Any] = {"idempotency": {"key": f"_meta.{META_KEY}"}}
#: Set in the ``_meta`` of a result that was replayed rather than run.
REPLAYED_META = "idempotencyReplayed"
#: Keys longer than this are refused (as the middleware refuses them).
MAX_KEY_LENGTH = 255


class ToolResultCodec:
    """A tool's result as its JSON (content, structured content, ``isError``, ``_meta``)."""

    def encode(self, value: Any) -> bytes:
        assert isinstance(value, CallToolResult)
        return value.model_dump_json(by_alias=True, exclude_none=True).encode()

    def decode(self, data: bytes) -> Any:
        result = CallToolResult.model_validate_json(data)
        return result.model_copy(update={"meta": {**(result.meta or {}), REPLAYED_META: True}})


class _NotARecord(Exception):
    """The tool asked for input instead of answering: nothing to record, the key released."""

    def __init__(self, result: HandlerResult) -> None:
        self.result = result


class IdempotentTools(Extension):
    """Runs each keyed ``tools/call`` once per key on ``store``:
    ``MCPServer("tickets", extensions=[IdempotentTools(store)])``.

    ``tools`` names the protected tools (default: every tool); the others run as they are,
    key or not. ``ttl``, ``lease``, ``wait``, ``max_result_bytes`` and ``on_event`` are
    :class:`~idempotency_mw.functions.IdempotentFunctions`' (``scope`` is the namespace of the
    keys). Advertised in the server's capabilities (``extensions``); put :data:`TOOL_META` in
    a protected tool's ``meta=`` to say so in ``tools/list`` too.
    """

    identifier = "io.github.idempotency-mw/idempotency"

    def __init__(
        self,
        store: Store,
        *,
        tools: Collection[str] | None = None,
        ttl: Duration = timedelta(hours=24),
        lease: Duration = timedelta(seconds=60),
        wait: Duration = 0,
        scope: str = "mcp",
        max_result_bytes: int = 1 << 20,
        on_event: EventHook | None = None,
    ) -> None:
        self.protected = None if tools is None else frozenset(tools)
        self.functions = IdempotentFunctions(
            store,
            ttl=ttl,
            lease=lease,
            wait=wait,
            scope=scope,
            codec=ToolResultCodec(),
            max_result_bytes=max_result_bytes,
            on_event=on_event,
        )

    def settings(self) -> dict[str, Any]:
        return {
            "key": f"_meta.{META_KEY}",
            "tools": None if self.protected is None else sorted(self.protected),
        }

    async def intercept_tool_call(
        self,
        params: CallToolRequestParams,
        ctx: ServerRequestContext[Any, Any],
        call_next: CallNext,
    ) -> HandlerResult:
        if self.protected is not None and params.name not in self.protected:
            return await call_next(ctx)
        key = (params.meta or {}).get(META_KEY)
        if key is None:
            # As a request without a key on an optional route: fence() has nothing to do.
            reset = current_claim.set(UNKEYED)
            try:
                return await call_next(ctx)
            finally:
                current_claim.reset(reset)
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise MCPError(
                INVALID_PARAMS,
                f"_meta.{META_KEY} must be a string of 1 to {MAX_KEY_LENGTH} characters",
            )

        async def run() -> CallToolResult:
            result = await call_next(ctx)
            if not isinstance(result, CallToolResult):
                raise _NotARecord(result)
            return result

        try:
            result = await self.functions.call(
                key, tool_fingerprint(params.name, params.arguments), run, name=params.name
            )
        except _NotARecord as not_a_record:
            return not_a_record.result
        except _REFUSED as exc:
            raise refusal(exc) from exc
        return cast(CallToolResult, result)

    async def aclose(self) -> None:
        """Wait for store calls still running for ended calls; the store stays open."""
        await self.functions.aclose()


def tool_fingerprint(name: str, arguments: dict[str, Any] | None) -> str:
    """What a call means: the tool's name and its arguments as canonical JSON."""
    text = json.dumps(
        [name, arguments or {}], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


#: Each refusal's problem and status.
_PROBLEMS: list[tuple[type[IdempotencyError], Problem, int]] = [
    (KeyReused, Problem.MISMATCH, 422),
    (StillRunning, Problem.IN_PROGRESS, 409),
    (ResultNotReplayable, Problem.UNREPLAYABLE, 409),
    (CommittedWithoutResult, Problem.COMMITTED_WITHOUT_RESPONSE, 409),
    (LeaseLost, Problem.LEASE_LOST, 503),
    (StoreError, Problem.STORE_UNAVAILABLE, 503),
]


_REFUSED = tuple(kind for kind, _, _ in _PROBLEMS)


def refusal(exc: IdempotencyError) -> MCPError:
    """The JSON-RPC error that tells the caller why its keyed call was not run: code
    :data:`IDEMPOTENCY_ERROR`, the problem (``type``, ``title``, ``status``, ``detail`` and,
    when a retry may help, ``retryAfter`` in seconds) as ``data``."""
    problem, status = next(
        (problem, status) for kind, problem, status in _PROBLEMS if isinstance(exc, kind)
    )
    # A store's message names the store; the caller is told only that it failed.
    detail = "the idempotency store failed" if isinstance(exc, StoreError) else str(exc)
    data: dict[str, Any] = {
        "type": problem.type_uri,
        "title": problem.value[1],
        "status": status,
        "detail": detail,
    }
    if RETRYABLE.get(problem):
        data["retryAfter"] = exc.retry_after if isinstance(exc, StillRunning) else 1
    return MCPError(IDEMPOTENCY_ERROR, f"{problem.value[1]}: {detail}", data=data)
