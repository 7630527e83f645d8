"""MCP tool calls once per key: an extension of the ``mcp`` SDK's ``MCPServer``, on
:class:`IdempotentMCPServer`, which tells it a crash from a deliberate error by type.

A ``tools/call`` whose ``params._meta["idempotencyKey"]`` is set runs through
:class:`~idempotency_mw.functions.IdempotentFunctions` on its key, fingerprinted by the tool's
name and arguments (never the JSON-RPC id or the session) and bound to the caller's
credentials. A call leaves behind what an HTTP request would: what the tool returned (an
``isError`` result too) or the ``MCPError`` it raised is recorded, and a retry (a new id, any
session, any transport) gets it framed for its own request; an unexpected exception releases
the key, like a 500, unless its effect committed (``fence()``): that call and its retries are
told so. A client that goes away never stops a tool that started. Calls without a key, and
every other method, are untouched. A call may say when its caller first sent it
(``_meta["idempotencyFirstSent"]``): one first sent longer ago than ``ttl`` whose key has no
record is refused, never run. The extension also serves :data:`LOOKUP_METHOD`, a caller's look
at its own key without calling the tool. Needs the ``[mcp]`` extra.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, Unpack

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.request_state import authenticated_principal
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ErrorData,
)
from pydantic import ValidationError
from starlette.requests import HTTPConnection
from typing_extensions import TypeVar

from idempotency_mw.engine.fence import UNKEYED, CurrentClaim
from idempotency_mw.functions import (
    COMMITTED_WITHOUT_RESULT,
    CommittedWithoutResult,
    CredentialMismatch,
    IdempotentFunctions,
    KeyExpired,
    KeyReused,
    ResultNotReplayable,
    StillRunning,
)
from idempotency_mw.stores.base import Store
from idempotency_mw.values.exceptions import IdempotencyError, LeaseLost, StoreError
from idempotency_mw.values.metrics import EventHook
from idempotency_mw.values.problems import RETRYABLE, Problem, store_failure
from idempotency_mw.values.settings import CallOptions
from idempotency_mw.wire.credentials import bound_headers, credential_digest
from idempotency_mw.wire.http import parse_first_sent
from idempotency_mw.wire.keys import current_claim, is_valid_key, key_rule
from idempotency_mw.wire.lookup import state_json
from idempotency_mw.wire.mcp import (
    FIRST_SENT_META,
    LOOKUP_METHOD,
    META_KEY,
    REPLAYED_META,
    RETRY_META,
    KeyLookupResult,
    LookupParams,
)

logger = logging.getLogger("idempotency_mw")

#: The JSON-RPC error code of every refusal; ``data`` is the problem (its ``type`` says which,
#: as in the middleware's problem+json answers, and callers read that, whatever the code).
#: Outside JSON-RPC's reserved -32768..-32000, where MCP 2026-07-28 wants new codes
#: (-32020..-32099 are its own); earlier versions sent -32030.
IDEMPOTENCY_ERROR = -31030
#: What a protected tool's ``_meta`` says, so that an agent can tell it from another.
TOOL_META: dict[str, Any] = {"idempotency": {"key": f"_meta.{META_KEY}"}}

#: The namespace of the keys: a string, or a callable of the call's request context that
#: returns the caller's namespace (awaited when it returns an awaitable).
Scope = str | Callable[[ServerRequestContext[Any, Any]], str | Awaitable[str]]


class ToolResultCodec:
    """A call's outcome as JSON: the tool's result (content, structured content, ``isError``,
    ``_meta``), or the JSON-RPC error it raised (``{"error": ...}``)."""

    def encode(self, value: Any) -> bytes:
        if isinstance(value, ErrorData):
            return json.dumps({"error": value.model_dump(mode="json", exclude_none=True)}).encode()
        assert isinstance(value, CallToolResult)
        return value.model_dump_json(by_alias=True, exclude_none=True).encode()

    def decode(self, data: bytes) -> Any:
        stored = json.loads(data)
        if stored.keys() == {"error"}:
            return ErrorData.model_validate(stored["error"])
        result = CallToolResult.model_validate(stored)
        return result.model_copy(update={"meta": {**(result.meta or {}), REPLAYED_META: True}})


class _Failure(enum.Enum):
    """How a tool call failed below the SDK's conversion of its exception into a result."""

    #: An ``UnexpectedToolError``: released like a 500 (unless its effect committed).
    CRASHED = "crashed"
    #: The tool was never reached (unknown, or its arguments failed the input schema):
    #: released like FastAPI's 422.
    NOT_REACHED = "not-reached"
    #: A deliberate ``ToolError`` (the tool's own answer): recorded.
    DELIBERATE = "deliberate"


@dataclass
class _ToolRun:
    """What :class:`IdempotentMCPServer` saw of the keyed call under way (``None``: the call
    did not go through one, so a crash cannot be told from a deliberate error)."""

    failure: _Failure | None = None


#: The keyed call under way, set by the interceptor around the SDK's handler.
_tool_run: ContextVar[_ToolRun | None] = ContextVar("idempotency_mw_tool_run", default=None)

#: The server's lifespan value, as ``MCPServer``'s (``Any`` unless told).
LifespanT = TypeVar("LifespanT", default=Any)


class IdempotentMCPServer(MCPServer[LifespanT], Generic[LifespanT]):
    """An ``MCPServer`` that tells :class:`IdempotentTools` how a tool failed, by the type the
    SDK raised (``UnexpectedToolError`` for a crash, ``ToolError`` for a deliberate failure),
    before the SDK turns it into an ``isError`` result. Build protected servers with it; on a
    plain ``MCPServer`` every ``isError`` result is recorded, crashes included (what cannot be
    told apart is never run twice)."""

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[LifespanT, Any] | None = None
    ) -> Any:
        run = _tool_run.get()
        if run is None or run.failure is not None:
            # Not a keyed call, or a tool the called tool calls: the outer call decides.
            return await super().call_tool(name, arguments, context)
        run.failure = _Failure.DELIBERATE
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            run.failure = await self._failure_of(exc, name)
            raise

    async def _failure_of(self, exc: ToolError, name: str) -> _Failure:
        if isinstance(exc, UnexpectedToolError):
            return _Failure.CRASHED
        # The SDK's own test for arguments that failed the input schema.
        if isinstance(exc.__cause__, ValidationError):
            return _Failure.NOT_REACHED
        if all(tool.name != name for tool in await self.list_tools()):
            return _Failure.NOT_REACHED
        return _Failure.DELIBERATE


class _Unrecorded(Exception):
    """The call's answer is not a record: its key is released, and this is answered."""

    def __init__(self, result: HandlerResult) -> None:
        self.result = result


class IdempotentTools(Extension):
    """Runs each keyed ``tools/call`` once per key on ``store``:
    ``IdempotentMCPServer("tickets", extensions=[protect], lifespan=protect.lifespan)`` with
    ``protect = IdempotentTools(store)``.

    ``tools`` names the protected tools (default: every tool); the others run as they are,
    key or not. ``scope`` is the namespace of the keys: a string (default ``"mcp"``), each
    record then bound to the caller's credentials (the SDK's authenticated client, or the
    ``Authorization`` header of the HTTP request) so that another caller never gets it; or a
    callable of the request context that returns the caller's namespace, which alone then
    decides (return one string for every caller to share records on purpose). The settings
    (``ttl``, ``lease``, ``wait``, ``fenced``: :class:`~idempotency_mw.CallOptions`),
    ``max_result_bytes``, ``on_event`` and ``server_checks`` are
    :class:`~idempotency_mw.functions.IdempotentFunctions`'. Advertised in the server's
    capabilities (``extensions``); put :data:`TOOL_META` in a protected tool's ``meta=`` to
    say so in ``tools/list`` too.
    """

    identifier = "io.github.idempotency-mw/idempotency"

    def __init__(
        self,
        store: Store,
        *,
        tools: Collection[str] | None = None,
        scope: Scope = "mcp",
        max_result_bytes: int = 1 << 20,
        on_event: EventHook | None = None,
        server_checks: bool = True,
        **settings: Unpack[CallOptions],
    ) -> None:
        self.protected = None if tools is None else frozenset(tools)
        self._warned = False
        self.scope = scope
        self.functions = IdempotentFunctions(
            store,
            scope=scope if isinstance(scope, str) else "mcp",
            codec=ToolResultCodec(),
            max_result_bytes=max_result_bytes,
            on_event=on_event,
            server_checks=server_checks,
            **settings,
        )

    def settings(self) -> dict[str, Any]:
        return {
            "key": f"_meta.{META_KEY}",
            "firstSent": f"_meta.{FIRST_SENT_META}",
            "lookup": LOOKUP_METHOD,
            "tools": None if self.protected is None else sorted(self.protected),
        }

    def methods(self) -> list[MethodBinding]:
        return [MethodBinding(LOOKUP_METHOD, LookupParams, self._lookup)]

    async def _lookup(self, ctx: ServerRequestContext[Any, Any], params: Any) -> HandlerResult:
        """What became of the caller's key, without running anything (another caller's key
        reads as one never seen)."""
        assert isinstance(params, LookupParams)
        if not is_valid_key(params.key):
            raise MCPError(INVALID_PARAMS, key_rule("key"))
        scope, binding = await self._caller(ctx)
        try:
            state = await self.functions.lookup(params.key, scope=scope, binding=binding)
        except StoreError as exc:
            raise refusal(exc) from exc
        found = KeyLookupResult.model_validate(state_json(state))
        recorded = None if state is None or state.response is None else state.response.body
        replay = None if recorded is None else self.functions.codec.decode(recorded)
        if isinstance(replay, CallToolResult):
            found.result = replay.model_dump(mode="json", by_alias=True, exclude_none=True)
        return found

    @asynccontextmanager
    async def lifespan(self, server: object) -> AsyncIterator[dict[str, Any]]:
        """The server's lifespan (``MCPServer(..., lifespan=protect.lifespan)``): the store is
        checked as the middleware checks it at start, so that a server whose table is missing
        fails to start, naming ``idempotency-mw migrate``."""
        await self.functions.startup()
        yield {}

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
        if not is_valid_key(key):
            raise MCPError(INVALID_PARAMS, key_rule(f"_meta.{META_KEY}"))
        sent = (params.meta or {}).get(FIRST_SENT_META)
        first_sent = None if sent is None else parse_first_sent(sent)
        if sent is not None and first_sent is None:
            raise MCPError(
                INVALID_PARAMS,
                f"_meta.{FIRST_SENT_META} must be an HTTP-date or an RFC 3339 date-time",
            )
        scope, binding = await self._caller(ctx)
        name = params.name

        async def run() -> CallToolResult | ErrorData:
            seen = _ToolRun()
            reset = _tool_run.set(seen)
            # A client that goes away (a timeout, a closed stream) cancels its request: a tool
            # that started finishes and is settled, as a request whose HTTP client left.
            try:
                with anyio.CancelScope(shield=True):
                    result = await call_next(ctx)
            except MCPError as exc:
                return exc.error
            finally:
                _tool_run.reset(reset)
            if seen.failure is None and isinstance(result, CallToolResult) and result.is_error:
                self._cannot_tell()
            return _outcome(result, seen.failure)

        try:
            outcome = await self.functions.call(
                key,
                tool_fingerprint(name, params.arguments),
                run,
                name=name,
                scope=scope,
                binding=binding,
                first_sent=first_sent,
            )
        except _Unrecorded as unrecorded:
            return unrecorded.result
        except _REFUSED as exc:
            raise refusal(exc) from exc
        if isinstance(outcome, ErrorData):
            raise MCPError.from_error_data(outcome)
        assert isinstance(outcome, CallToolResult)
        return outcome

    def _cannot_tell(self) -> None:
        """Say once that this server's crashes are recorded (it is not an
        :class:`IdempotentMCPServer`)."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "IdempotentTools: a tool answered an error on a server that is not an "
                "IdempotentMCPServer, where a crash cannot be told from a deliberate error: "
                "it is recorded, and its retries get it replayed (said once)"
            )

    async def _caller(self, ctx: ServerRequestContext[Any, Any]) -> tuple[str, str]:
        """The call's scope, and the digest of the credentials its record is bound to."""
        if isinstance(self.scope, str):
            return self.scope, caller_binding(ctx)
        try:
            value = self.scope(ctx)
            if inspect.isawaitable(value):
                value = await value
        except MCPError:
            raise
        except Exception:
            logger.exception("the scope= callable of IdempotentTools failed")
            raise _scope_failed() from None
        if not isinstance(value, str) or not value:
            logger.error(
                "the scope= callable of IdempotentTools returned %s; it must return a non-empty "
                "string (the tool did not run)",
                "an empty string" if value == "" else f"a {type(value).__name__}",
            )
            raise _scope_failed()
        return value, ""

    async def aclose(self) -> None:
        """Wait for store calls still running for ended calls; the store stays open."""
        await self.functions.aclose()


def caller_binding(ctx: ServerRequestContext[Any, Any]) -> str:
    """A digest of the caller's credentials: the SDK's authenticated principal (the client,
    issuer and subject it binds sessions to, which a refreshed token keeps), else the
    credentials of the HTTP request that carried the call, as the middleware binds them by
    default; ``""`` without any (stdio, in process)."""
    principal = authenticated_principal(ctx)
    if principal is not None:
        return credential_digest([("mcp-principal", principal)])
    request = ctx.request
    if isinstance(request, HTTPConnection):
        values = bound_headers(request.headers.items())
        if values:
            return credential_digest(values)
    return ""


def tool_fingerprint(name: str, arguments: dict[str, Any] | None) -> str:
    """What a call means: the tool's name and its arguments as canonical JSON."""
    text = json.dumps(
        [name, arguments or {}], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _outcome(result: HandlerResult, failure: _Failure | None) -> CallToolResult | ErrorData:
    """What a call that answered ``result`` (having raised ``failure``, as
    :class:`IdempotentMCPServer` saw it) leaves behind: the result to record, or the
    committed-without-response refusal; raises :class:`_Unrecorded` when the key is released
    instead (the tool asked for input, was never reached, or crashed)."""
    if not isinstance(result, CallToolResult):
        raise _Unrecorded(result)
    if not result.is_error or failure in (None, _Failure.DELIBERATE):
        return result
    if failure is _Failure.NOT_REACHED:
        raise _Unrecorded(result)
    claim = current_claim.get()
    if isinstance(claim, CurrentClaim) and (claim.fenced or claim.committed_earlier):
        return _COMMITTED
    meta = {**(result.meta or {}), RETRY_META: True}
    raise _Unrecorded(result.model_copy(update={"meta": meta}))


#: Each refusal's problem and status.
_PROBLEMS: list[tuple[type[IdempotencyError], Problem, int]] = [
    (KeyReused, Problem.MISMATCH, 422),
    (CredentialMismatch, Problem.CREDENTIAL_MISMATCH, 409),
    (StillRunning, Problem.IN_PROGRESS, 409),
    (ResultNotReplayable, Problem.UNREPLAYABLE, 409),
    (CommittedWithoutResult, Problem.COMMITTED_WITHOUT_RESPONSE, 409),
    (KeyExpired, Problem.EXPIRED_KEY, 412),
    (LeaseLost, Problem.LEASE_LOST, 503),
]


_REFUSED: tuple[type[IdempotencyError], ...] = (*(kind for kind, _, _ in _PROBLEMS), StoreError)


def refusal(exc: IdempotencyError) -> MCPError:
    """The JSON-RPC error that tells the caller why its keyed call was not run: code
    :data:`IDEMPOTENCY_ERROR`, the problem (``type``, ``title``, ``status``, ``detail`` and,
    when a retry may help, ``retryAfter`` in seconds) as ``data``."""
    if isinstance(exc, StoreError):
        problem, status, words = store_failure(exc)
        # A store's message names the store; the caller is told only that it failed.
        detail = words or "the idempotency store failed"
    else:
        problem, status = next(
            (problem, status) for kind, problem, status in _PROBLEMS if isinstance(exc, kind)
        )
        detail = str(exc)
    retry_after = exc.retry_after if isinstance(exc, StillRunning) else 1
    return _problem_error(problem, status, detail, retry_after)


def _problem_error(problem: Problem, status: int, detail: str, retry_after: float) -> MCPError:
    data: dict[str, Any] = {
        "type": problem.type_uri,
        "title": problem.value[1],
        "status": status,
        "detail": detail,
    }
    if RETRYABLE.get(problem):
        data["retryAfter"] = retry_after
    return MCPError(IDEMPOTENCY_ERROR, f"{problem.value[1]}: {detail}", data=data)


def _scope_failed() -> MCPError:
    return _problem_error(
        Problem.SCOPE_FAILED,
        500,
        "the server could not determine whose call this is; the tool did not run",
        1,
    )


#: What a crashed call whose effect committed answers, and its retries with it.
_COMMITTED = refusal(CommittedWithoutResult(COMMITTED_WITHOUT_RESULT)).error
