"""MCP tool calls as operations: one journaled key per logical call, sent in ``params._meta``.

A tool call is an operation like any other (same protocol, journal, retries, leases,
confirmation and reconcile): :class:`ToolTransport` carries the client's ``POST
/tools/<name>`` requests as ``tools/call`` over an MCP session, with the operation's key as
``_meta["idempotencyKey"]``, so a call retried after a timeout, a dropped connection, on a new
session or after a restart reaches the server under the key it was first sent with. Needs the
``[mcp]`` extra.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Protocol, Unpack, cast

import anyio
import httpx
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    PARSE_ERROR,
    REQUEST_TIMEOUT,
    CallToolResult,
    ErrorData,
    Request,
    RequestParamsMeta,
)

from idempotency_mw.client._closing import AClosedOnExit
from idempotency_mw.client.async_client import AsyncProbe, IdempotentClient
from idempotency_mw.client.errors import OperationError
from idempotency_mw.client.journals import DEFAULT_JOURNAL_PATH, Journal
from idempotency_mw.client.protocol import ProtocolOptions
from idempotency_mw.client.saga import AsyncStepClient
from idempotency_mw.client.values import Operation
from idempotency_mw.values.exceptions import ConfigurationError, describe
from idempotency_mw.wire.http import (
    FIRST_SENT_HEADER,
    KEY_HEADER,
    PROBLEM_TYPE_PREFIX,
    REPLAYED_HEADER,
)
from idempotency_mw.wire.mcp import (
    FIRST_SENT_META,
    LOOKUP_METHOD,
    META_KEY,
    RETRY_META,
    KeyLookupResult,
    LookupParams,
)

#: The base URL of the requests :class:`ToolTransport` carries (never resolved).
TOOLS_URL = "http://mcp.tools"
#: The ``lookup_path`` :class:`IdempotentToolCaller` gives its client: its ``GET <path>/<key>``
#: is carried as the server's :data:`~idempotency_mw.wire.mcp.LOOKUP_METHOD` request.
LOOKUP_PATH = "/idempotency-keys"


def key_meta(key: str, first_sent: str | None = None) -> RequestParamsMeta:
    """The ``_meta`` of a ``tools/call`` that carries ``key`` (and, given, when the call was
    first sent: an HTTP-date): ``call_tool(..., meta=...)``."""
    meta = {META_KEY: key} if first_sent is None else {META_KEY: key, FIRST_SENT_META: first_sent}
    # RequestParamsMeta is an open TypedDict (extra_items=Any), which type checkers do not
    # all know yet: they would refuse its extra key.
    return cast(RequestParamsMeta, meta)


# The session could not be used, whether or not the call had reached the server.
_BROKEN = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)

# The JSON-RPC errors the mcp SDK's client makes up itself, without data, when no answer
# arrived (the connection closed or an SSE stream ended, a session's own timeout, an HTTP
# error without a JSON-RPC body, an answer it could not parse, a session the server forgot)
# or that its server sends for a handler that crashed (a 500): by their code and the start of
# their message. The call may have run or not: it is sent again under its key. Any other
# JSON-RPC error is the server's answer.
_UNANSWERED: dict[int, tuple[str, ...]] = {
    CONNECTION_CLOSED: ("Connection closed", "SSE stream ended", "SSE stream failed"),
    REQUEST_TIMEOUT: ("Request 'tools/call' timed out", "Timed out after "),
    INTERNAL_ERROR: ("Server returned an error response", "Internal server error"),
    PARSE_ERROR: ("Failed to parse ",),
    INVALID_REQUEST: ("Session terminated",),
}


def _unanswered(error: ErrorData) -> bool:
    return error.data is None and error.message.startswith(_UNANSWERED.get(error.code, ()))


class ToolCallError(OperationError):
    """The server answered the tool call with a JSON-RPC error, ``error`` (its code, message
    and data): its final answer, journaled ``failed``; ``response`` carries it."""

    def __init__(self, error: ErrorData, key: str, response: httpx.Response) -> None:
        super().__init__(f"JSON-RPC error {error.code}: {error.message}", key, response)
        self.error = error


class ToolSession(Protocol):
    """What a call needs of an MCP session: ``mcp.ClientSession`` and ``mcp.client.Client``.
    A lookup of a key goes through ``send_request``: the session's own, or its ``session``'s
    (a ``Client``'s); a session that has neither answers lookups 404 (the call is sent
    again)."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        progress_callback: Any = None,
        *,
        meta: Any = None,
    ) -> CallToolResult: ...


#: Opens a session for one attempt: an async context manager that yields it.
Connect = Callable[[], AbstractAsyncContextManager[ToolSession]]


def tool_path(name: str) -> str:
    """The path of the request that calls the tool ``name``."""
    return f"/tools/{name}"


def tool_result(response: httpx.Response, *, key: str = "") -> CallToolResult:
    """The tool's result carried by ``response`` (a tool's error is a result too); raises
    :class:`ToolCallError` (naming ``key``) when the server answered with a JSON-RPC error."""
    body = response.json()
    if isinstance(body, dict) and body.keys() == {"error"}:
        raise ToolCallError(ErrorData.model_validate(body["error"]), key, response)
    return CallToolResult.model_validate(body)


class ToolTransport(httpx.AsyncBaseTransport):
    """Carries ``POST /tools/<name>`` (JSON arguments, the key in ``header_name``, the time it
    was first sent in ``first_sent_header``) as ``tools/call`` over ``session`` (yours: it is
    never closed here) or, given ``connect``, a session of each attempt's own, opened and
    closed within it, so that a broken connection is replaced at the next attempt.

    The answers read like HTTP, so that the client's rules apply unchanged: a result is 200,
    a tool's error 422 (final: it ran and said no) or 500 when the tool crashed and the server
    released its key (retried), the server's idempotency refusal its problem, any other
    JSON-RPC error of the server 400 (final); a timeout (the request's read timeout, kept
    here) is a read timeout, and a broken session or an error the SDK made up because no
    answer came a protocol error (either may have reached the server: retried under the same
    key); a session that cannot be opened is a connect error (nothing was sent).
    """

    def __init__(
        self,
        session: ToolSession | None = None,
        *,
        connect: Connect | None = None,
        header_name: str = KEY_HEADER,
        first_sent_header: str | None = FIRST_SENT_HEADER,
    ) -> None:
        if (session is None) == (connect is None):
            raise ConfigurationError("give an MCP session, or connect= to open one per attempt")
        self._session = session
        self._connect = connect
        self._header = header_name
        self._first_sent = first_sent_header

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._session is not None:
            outcome = await self._carry(self._session, request)
        else:
            outcome = await self._call_in_own_session(request)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def _call_in_own_session(
        self, request: httpx.Request
    ) -> httpx.Response | httpx.TransportError:
        """The call in a session opened for it. The outcome is raised once the session is
        closed: raised inside, it would come out of the session's task group wrapped in an
        exception group."""
        assert self._connect is not None
        outcome: httpx.Response | httpx.TransportError | None = None
        try:
            async with AsyncExitStack() as stack:
                try:
                    session = await stack.enter_async_context(self._connect())
                except Exception as exc:
                    return _caused(
                        httpx.ConnectError(f"no MCP session: {describe(exc)}", request=request),
                        exc,
                    )
                outcome = await self._carry(session, request)
        except Exception as exc:
            if outcome is not None:
                return outcome  # the session failed as it closed, after the call's outcome
            lost = f"the MCP session broke: {describe(exc)}"
            return _caused(httpx.RemoteProtocolError(lost, request=request), exc)
        assert outcome is not None
        return outcome

    async def _carry(
        self, session: ToolSession, request: httpx.Request
    ) -> httpx.Response | httpx.TransportError:
        if request.method == "GET":  # the client asks what became of a key
            return await self._look_up(session, request)
        return await self._call(session, request)

    async def _look_up(
        self, session: ToolSession, request: httpx.Request
    ) -> httpx.Response | httpx.TransportError:
        """``GET <lookup path>/<key>`` as the server's lookup: the recorded result replayed
        (as :meth:`_call` answers a result), else the key's state as the middleware's lookup
        answers it; a server without the lookup answers 404 (the client then sends again)."""
        key = request.url.path.rpartition("/")[2]
        asked = Request[LookupParams, str](method=LOOKUP_METHOD, params=LookupParams(key=key))
        timeout = request.extensions.get("timeout", {}).get("read")
        # A Client holds its ClientSession as .session; a ClientSession is its own.
        sender: Any = getattr(session, "session", session)
        if not hasattr(sender, "send_request"):
            return httpx.Response(404, json={"error": "no lookup on this session"}, request=request)
        try:
            with anyio.fail_after(timeout):
                found = await sender.send_request(asked, KeyLookupResult)
        except TimeoutError as exc:
            return _caused(httpx.ReadTimeout(f"{LOOKUP_METHOD}: no answer", request=request), exc)
        except (MCPError, *_BROKEN) as exc:
            return httpx.Response(404, json={"error": describe(exc)}, request=request)
        if found.result is not None:
            replay = _result_response(CallToolResult.model_validate(found.result), request)
            replay.headers[REPLAYED_HEADER] = "true"
            return replay
        state = found.model_dump(mode="json", exclude_none=True, exclude={"meta", "result"})
        return httpx.Response(200, json=state, request=request)

    async def _call(
        self, session: ToolSession, request: httpx.Request
    ) -> httpx.Response | httpx.TransportError:
        name = request.url.path.removeprefix("/tools/")
        arguments = json.loads(await request.aread() or b"{}")
        key = request.headers.get(self._header)
        sent = None if self._first_sent is None else request.headers.get(self._first_sent)
        timeout = request.extensions.get("timeout", {}).get("read")
        try:
            # The timeout is the caller's own, so that it is never mistaken for an answer.
            with anyio.fail_after(timeout):
                result = await session.call_tool(
                    name, arguments or None, meta=None if key is None else key_meta(key, sent)
                )
        except TimeoutError as exc:
            lost = f"tools/call {name}: no answer within {timeout} s"
            return _caused(httpx.ReadTimeout(lost, request=request), exc)
        except MCPError as exc:
            problem = exc.error.data
            if isinstance(problem, dict) and str(problem.get("type")).startswith(
                PROBLEM_TYPE_PREFIX
            ):
                # The server's idempotency refusal: read as the middleware's problem answer.
                return _problem_response(problem, request)
            if _unanswered(exc.error):
                lost = f"tools/call {name}: {exc}"
                return _caused(httpx.RemoteProtocolError(lost, request=request), exc)
            body = {"error": exc.error.model_dump(mode="json", exclude_none=True)}
            return httpx.Response(400, json=body, request=request)
        except _BROKEN as exc:
            lost = f"tools/call {name}: {describe(exc)}"
            return _caused(httpx.RemoteProtocolError(lost, request=request), exc)
        return _result_response(result, request)


def _result_response(result: CallToolResult, request: httpx.Request) -> httpx.Response:
    """A tool's result as an answer: 200, 422 for its error, or 500 when the tool crashed and
    the server released its key."""
    body = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    if not result.is_error:
        return httpx.Response(200, json=body, request=request)
    retry = (result.meta or {}).get(RETRY_META) is True
    return httpx.Response(500 if retry else 422, json=body, request=request)


def _problem_response(problem: dict[str, Any], request: httpx.Request) -> httpx.Response:
    status = problem.get("status")
    headers = {"content-type": "application/problem+json"}
    retry_after = problem.get("retryAfter")
    if isinstance(retry_after, int | float) and retry_after >= 0:
        headers["retry-after-ms"] = str(int(retry_after * 1000))
    return httpx.Response(
        status if isinstance(status, int) and 400 <= status < 600 else 409,
        content=json.dumps(problem).encode(),
        headers=headers,
        request=request,
    )


def _caused(error: httpx.TransportError, cause: BaseException) -> httpx.TransportError:
    error.__cause__ = cause
    return error


class IdempotentToolCaller(AClosedOnExit):
    """Calls MCP tools with one journaled key per logical call, in ``params._meta``.

    ``session`` is an open ``mcp.ClientSession`` or ``mcp.client.Client`` (yours to close);
    or ``connect`` opens a session for each attempt (``lambda: Client(url)``, or a context
    manager of your own that yields a ``ClientSession``), so a broken one is replaced.
    :meth:`call_tool` with ``ref`` names a logical call: the same tool and ``ref`` (in this
    process, or another after a restart) is the same key, and a settled call is answered from
    the journal; a call whose answer was lost is looked up on the server (its
    ``idempotency/lookup``) before it is sent again. Options are :class:`IdempotentClient`'s
    (``lookup_path=None`` turns the lookup off); ``client`` is the client underneath,
    for :class:`Saga` steps (see :class:`ToolStep`), ``reconcile()`` and ``attention()``.
    """

    def __init__(
        self,
        session: ToolSession | None = None,
        *,
        connect: Connect | None = None,
        journal: Journal | str | os.PathLike[str] = DEFAULT_JOURNAL_PATH,
        confirm: Mapping[str, AsyncProbe] | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        clock: Callable[[], float] = time.monotonic,
        **options: Unpack[ProtocolOptions],
    ) -> None:
        transport = ToolTransport(
            session,
            connect=connect,
            header_name=options.get("header_name", KEY_HEADER),
            first_sent_header=options.get("first_sent_header", FIRST_SENT_HEADER),
        )
        settings: ProtocolOptions = {"lookup_path": LOOKUP_PATH, **options}
        self.client = IdempotentClient(
            http=httpx.AsyncClient(transport=transport, base_url=TOOLS_URL),
            journal=journal,
            confirm=confirm,
            sleep=sleep,
            clock=clock,
            **settings,
        )

    async def operation(self, tool: str, *, ref: str | None = None) -> Operation:
        """Decide a call of ``tool`` (see :meth:`IdempotentClient.operation`)."""
        return await self.client.operation(tool, ref=ref)

    async def send(
        self, operation: Operation, arguments: dict[str, Any] | None = None
    ) -> CallToolResult:
        """Call the tool of ``operation`` (its name) with ``arguments`` under its key, retrying
        until its outcome is known; raises what :meth:`IdempotentClient.send` raises, and
        :class:`ToolCallError` when the server answered with a JSON-RPC error."""
        response = await self.client.send(
            operation, "POST", tool_path(operation.name), json=arguments
        )
        return tool_result(response, key=operation.key)

    async def call_tool(
        self, tool: str, arguments: dict[str, Any] | None = None, *, ref: str | None = None
    ) -> CallToolResult:
        """Decide a call of ``tool`` (resumed by ``ref``) and send it."""
        return await self.send(await self.operation(tool, ref=ref), arguments)

    async def aclose(self) -> None:
        """Close the journal, if this caller opened it."""
        await self.client.http.aclose()
        await self.client.aclose()


class ToolStep:
    """A :class:`Saga` step or compensation that calls ``tool`` with ``arguments`` under the
    step's key; the saga runs on :attr:`IdempotentToolCaller.client`. :func:`tool_result`
    reads the step's response."""

    def __init__(self, tool: str, arguments: dict[str, Any] | None = None) -> None:
        self.tool = tool
        self.arguments = arguments

    async def __call__(
        self, step: AsyncStepClient, response: httpx.Response | None = None
    ) -> httpx.Response:
        return await step.post(tool_path(self.tool), json=self.arguments)
