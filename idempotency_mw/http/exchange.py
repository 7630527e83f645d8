"""One keyed HTTP request: body, caller, fingerprint, then claim and run, replay or refuse."""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw.engine.claim import Call, ClaimEngine, ClaimRequest, Hold, LeaseUnproven
from idempotency_mw.engine.fence import (
    AT_THE_ENDPOINT,
    UNPROTECTED,
    AnsweredInstead,
    CurrentClaim,
    current_entrance,
)
from idempotency_mw.engine.fingerprint import request_fingerprint
from idempotency_mw.http._asgi import ReplayReceive, ResponseRecorder, send_replay
from idempotency_mw.http.caller import caller_scope, credential_binding, scope_failed
from idempotency_mw.http.door import ENDPOINT, ROUTE
from idempotency_mw.http.options import Options
from idempotency_mw.http.retention import KeyAnswers
from idempotency_mw.values.exceptions import EffectCommitted, LeaseLost, StoreError
from idempotency_mw.values.metrics import EventKind
from idempotency_mw.values.problems import Problem, send_problem, store_failure
from idempotency_mw.values.records import Claim, ClaimOutcome
from idempotency_mw.values.settings import Settings
from idempotency_mw.wire.keys import current_claim

logger = logging.getLogger("idempotency_mw")

#: The answer to each outcome that neither runs nor replays: problem, status (MISMATCH's is the
#: ``mismatch_status`` option) and detail.
_REFUSALS: dict[ClaimOutcome, tuple[Problem, int, str]] = {
    ClaimOutcome.IN_PROGRESS: (
        Problem.IN_PROGRESS,
        409,
        "A request with this key is still being processed; retry later.",
    ),
    ClaimOutcome.MISMATCH: (
        Problem.MISMATCH,
        409,
        "This key was used with a different request; use a new key for a new request.",
    ),
    ClaimOutcome.UNREPLAYABLE: (
        Problem.UNREPLAYABLE,
        409,
        "This key's request ran, but its response could not be recorded for replay.",
    ),
    ClaimOutcome.CREDENTIAL_MISMATCH: (
        Problem.CREDENTIAL_MISMATCH,
        409,
        "This key was used by a request with other credentials; its outcome is theirs. Use a "
        "new key, or the credentials of the first request.",
    ),
    ClaimOutcome.COMMITTED_WITHOUT_RESPONSE: (
        Problem.COMMITTED_WITHOUT_RESPONSE,
        409,
        "This key's request took effect, but its response is not available; do not send it again.",
    ),
    ClaimOutcome.EXPIRED: (
        Problem.EXPIRED_KEY,
        412,
        "This request was first sent longer ago than this server keeps its key, or later than "
        "now: whether it ran cannot be told, so it did not run. Look its outcome up by other "
        "means; send a new request with a new key.",
    ),
}


class Exchange:
    """One keyed request through the middleware.

    The claim is taken at the route's door when it has one (see :mod:`idempotency_mw.http.door`),
    else before the app runs. What the app sends before the door opens is passed on untouched
    and nothing is recorded; once the door opened, the response is recorded (or the key
    released) when it ends; when the middleware answered at the door, what the app sends is
    dropped.
    """

    def __init__(
        self,
        app: ASGIApp,
        options: Options,
        engine: ClaimEngine,
        scope: Scope,
        receive: Receive,
        answers: KeyAnswers,
        headers: dict[str, list[str]],
        key: str,
        template: str,
        settings: Settings,
    ) -> None:
        self.app = app
        self.options = options
        self.engine = engine
        self.scope = scope
        self.receive = receive
        #: Every answer goes out through it, which says what it means for the key.
        self.answers = answers
        self.send = answers.send
        self.headers = headers
        self.key = key
        self.template = template
        self.settings = settings
        self._fingerprint = ""
        self._caller = ""
        self._binding = ""
        self._hold: Hold | None = None
        self._recorder: ResponseRecorder | None = None
        #: What the door decided: the claim to hand ``fence()``, or ``None`` once answered.
        self._entry: CurrentClaim | str | None = None
        self._doors: str | None = None
        self._entered = False
        #: Whether the endpoint began (its effect may have happened).
        self._began = True
        self._settled = False
        #: ``fence()`` found an earlier run's proof: the app's database decides this key.
        self._refused_by_proof = False

    async def run(self, *, doors: str | None, body: bytes | None = None) -> None:
        """Handle the request; ``doors``: which doors its route has (see
        :func:`~idempotency_mw.http.door.doors_of`; ``None``: none, so whatever the app answers
        counts as the endpoint's); ``body``: the request's, when it was read already (its key
        is in it)."""
        self._doors = doors
        options = self.options
        if body is None:
            body = await read_body(self.receive, self.send, self.headers, self.settings, options)
            if body is None:
                return
        caller = await caller_scope(self.options, self.scope, self.send)
        if caller is None:
            return
        # A route that reads its own key keeps its keys apart: two senders may use one id.
        self._caller = (
            caller
            if self.settings.key is None
            else f"{caller} {self.scope['method']} {self.template}".lstrip()
        )
        self._binding = credential_binding(self.options, self.scope, self.headers)
        self._fingerprint = self._request_fingerprint(body)
        scoped = self.settings.scoped
        if scoped and doors != ENDPOINT:
            logger.error(
                "%s %s declares @idempotent(scope=...) but is not a FastAPI route the "
                "middleware can claim at (the endpoint did not run)",
                self.scope["method"],
                self.template,
            )
            await self._scope_failed()
            return
        # Claimed now, so that a replay or a refusal never runs the app; the doors (where the
        # route has them) tell whether the endpoint began. A caller scope from a dependency is
        # known only at the endpoint's door: that claim waits for it.
        call: Call | None = None
        claimed: Claim | str | None = None
        if not scoped:
            call = self._new_call(self._caller, self._binding)
            claimed = await self._claimed(call)
            if claimed is None:
                return
        recorder = self._recorder = ResponseRecorder(
            self.send,
            max_body=options.max_response_bytes,
            max_headers=options.max_header_bytes,
            records_header=options.records_header,
            on_finish=self._settle,
        )

        async def answer_stopped() -> None:
            if recorder.status is None:
                await self._problem(
                    Problem.LEASE_LOST,
                    503,
                    "The request was stopped because the idempotency store could not confirm "
                    "it still held this key; retry with the same key.",
                )

        try:
            async with self.engine.hold(
                answered=lambda: recorder.status is not None, on_stopped=answer_stopped
            ) as hold:
                await self._run_held(hold, call, claimed, body, recorder)
        finally:
            # The exchange, its recorder, its hold and its answers' rule refer to one another:
            # let go of them, so that the request's objects are freed with it instead of left
            # to the collector.
            self._hold = self._recorder = None
            self.answers.finished()

    async def _run_held(
        self,
        hold: Hold,
        call: Call | None,
        claimed: Claim | str | None,
        body: bytes,
        recorder: ResponseRecorder,
    ) -> None:
        """Run the app while ``hold`` keeps the claim (once taken), then settle the key."""
        self._hold = hold
        try:
            self._began = self._doors is None
            entry = None
            if call is not None and claimed is not None:
                entry = await self._kept(call, claimed)
                if entry is None:
                    return
            # Claimed before the app ran, what it sends goes one way; claimed at the door, the
            # way changes there.
            send: Send = self._send_from_app
            if entry is not None:
                send = recorder.send if isinstance(entry, CurrentClaim) else self.send
            reset = current_claim.set(entry)
            entrance = current_entrance.set(None if self._doors is None else self)
            try:
                await self.app(self.scope, ReplayReceive(body, self.receive), send)
            except AnsweredInstead:
                pass  # fence() in a dependency found a replay or a refusal, answered already
            except EffectCommitted:
                if recorder.status is not None:
                    raise
                # fence() found the proof of an earlier run that committed (the store forgot it):
                # the answer is recorded, so a retry is told the same without running again.
                self._began = self._refused_by_proof = True
                problem, status, detail = _REFUSALS[ClaimOutcome.COMMITTED_WITHOUT_RESPONSE]
                await send_problem(
                    recorder.send, problem, status, detail, retry_after=self.options.retry_after
                )
            except LeaseLost:
                if recorder.status is not None:
                    raise
                # fence() found the key taken over, and the app's transaction rolled back.
                await self._problem(
                    Problem.IN_PROGRESS,
                    409,
                    "Another request with this key took over; retry later.",
                )
            finally:
                current_entrance.reset(entrance)
                current_claim.reset(reset)
        finally:
            if not hold.stopped:
                await self._settle(recorder)

    def passed(self, *, endpoint: bool) -> bool:
        """A door passed: see :class:`~idempotency_mw.engine.fence.Entrance`. The endpoint began at
        the endpoint's door, or at the route's door of a route without one."""
        if endpoint or self._doors == ROUTE:
            self._began = True
        return self._entered and self._entry is not None

    async def enter(self, caller_scope: object, *, endpoint: bool) -> CurrentClaim | str | None:
        """A door passed, the key claimed there unless it was before: see
        :class:`~idempotency_mw.engine.fence.Entrance`."""
        self.passed(endpoint=endpoint)
        if self._entered:
            return self._entry  # the key is claimed once
        if self.settings.scoped and not endpoint:
            return AT_THE_ENDPOINT
        self._entered = True
        call = await self._call_for(caller_scope)
        claimed = None if call is None else await self._claimed(call)
        if call is None or claimed is None:
            return None
        return await self._kept(call, claimed)

    async def _call_for(self, caller_scope: object) -> Call | None:
        """The key's way through the engine in the caller's scope (``caller_scope``: the scope
        dependency's value, on a route whose claim waited for it), or ``None`` when the scope
        is unusable (answered)."""
        if caller_scope is None:
            logger.error(
                "%s %s declares @idempotent(scope=...) but its dependency was not resolved: "
                "put @idempotent below the route decorator (the endpoint did not run)",
                self.scope["method"],
                self.template,
            )
            await self._scope_failed()
            return None
        if not isinstance(caller_scope, str) or not caller_scope:
            logger.error(
                "the scope dependency of %s %s returned %r; it must return a non-empty "
                "string (the endpoint did not run)",
                self.scope["method"],
                self.template,
                type(caller_scope).__name__,
            )
            await self._scope_failed()
            return None
        return self._new_call(caller_scope, "")

    def _new_call(self, caller: str, binding: str) -> Call:
        """The key's way through the engine in the scope ``caller``, bound to ``binding``."""
        return self.engine.call(
            ClaimRequest(
                caller,
                self.key,
                self._fingerprint,
                ttl=self.settings.ttl,
                lease=self.settings.lease,
                wait=self.settings.wait,
                binding=binding,
                fenced=self.settings.fenced,
                first_sent=self.answers.first_sent,
            ),
            method=self.scope["method"],
            route=self.template,
        )

    async def _claimed(self, call: Call) -> Claim | str | None:
        """``call``'s claim when acquired; :data:`UNPROTECTED` when the store failed and the
        request runs unprotected (``fail_open``); ``None`` once answered (a replay, a
        refusal, the store unavailable)."""
        try:
            claim = await call.claim()
        except StoreError as exc:
            if self.options.fail_open:
                logger.warning(
                    "idempotency store failed to claim key %s; the request runs unprotected "
                    "(fence() does nothing for it): %s",
                    call.key_id,
                    exc,
                )
                return UNPROTECTED
            logger.warning("idempotency store failed to claim key %s: %s", call.key_id, exc)
            problem, status, words = store_failure(exc)
            await self._problem(
                problem,
                status,
                words or "The idempotency store is unavailable; retry with the same key.",
            )
            return None
        if claim.outcome is ClaimOutcome.ACQUIRED:
            self.answers.ran(self.settings.ttl, self._keeps)
            return claim
        if claim.outcome is ClaimOutcome.IN_PROGRESS:
            # Kept until ttl after the running request's completion: later than now + ttl.
            self.answers.ran(self.settings.ttl)
        elif claim.outcome is ClaimOutcome.EXPIRED:
            self.answers.reject()  # nothing is kept: the caller's record may have been purged
        else:
            self.answers.found(claim.expires_at, claim.outcome)
        if claim.outcome is ClaimOutcome.REPLAY:
            assert claim.response is not None
            await send_replay(self.send, claim.response)
            return None
        problem, status, detail = _REFUSALS[claim.outcome]
        if claim.outcome is ClaimOutcome.MISMATCH:
            status = self.options.mismatch_status
        await self._problem(problem, status, detail)
        return None

    async def _kept(self, call: Call, claimed: Claim | str) -> CurrentClaim | str | None:
        """The claim the request goes on with, its lease now kept by the request's hold (or
        :data:`UNPROTECTED`); ``None`` once answered."""
        self._entered = True
        if isinstance(claimed, str):
            self._entry = claimed
            return claimed
        assert self._hold is not None
        try:
            self._entry = await self._hold.keep(call, claimed)
        except LeaseUnproven:
            # A claim so slow that its lease may already be another's: run nothing.
            await self._problem(
                Problem.LEASE_LOST,
                503,
                "The idempotency store could not confirm this request holds its key; "
                "nothing ran. Retry with the same key.",
            )
            return None
        return self._entry

    async def _send_from_app(self, message: Message) -> None:
        """The app's ``send``: untouched before the door, recorded behind it, dropped once
        the middleware answered."""
        if not self._entered:
            await self.send(message)
        elif isinstance(self._entry, CurrentClaim):
            assert self._recorder is not None
            await self._recorder.send(message)
        elif self._entry == UNPROTECTED:
            await self.send(message)

    async def _settle(self, recorder: ResponseRecorder) -> None:
        """Record the response, or release the key when it proves the endpoint did nothing.
        Once (when the response ends, or when the app returns or fails without ending it)."""
        hold = self._hold
        if self._settled or hold is None or hold.call is None or hold.claim_held is None:
            return
        self._settled = True
        await self._record_or_release(hold.call, hold.claim_held.token, recorder)

    async def _record_or_release(self, call: Call, token: str, recorder: ResponseRecorder) -> None:
        """Once the endpoint began, its effect may have happened: every response below 500 is
        recorded (one cut short, sent as a file or too large as not replayable). Released: an
        answer given before the endpoint's door (unless ``fence()`` marked an effect), no
        response or a 5xx (unless ``store_server_errors``), a status of the route's
        ``release_statuses``, and a framework's request validation answer (FastAPI's 422 on a
        route without an endpoint's door, Litestar's 400): it came before the endpoint."""
        status = recorder.status
        if status is None or not self._keeps(status) or recorder.is_request_validation_error():
            await call.release(token)
            return
        response = recorder.stored_response()
        if response is None:
            if recorder.too_large:
                call.emit(EventKind.RECORD_TOO_LARGE)
            logger.warning(
                "the response of key %s cannot be replayed: %s",
                call.key_id,
                recorder.unreplayable_reason or "it was cut short",
            )
        await call.complete(token, response, fenced=self._entry_fenced() or self._refused_by_proof)

    def _keeps(self, status: int) -> bool:
        """Whether an answer of ``status`` is recorded, as far as its status line tells (a
        framework's validation answer is told by its body): the endpoint began or
        ``fence()`` marked an effect, and neither a 5xx (unless ``store_server_errors``) nor
        one of the route's ``release_statuses``."""
        return (
            (self._began or self._entry_fenced())
            and (status < 500 or self.options.store_server_errors)
            and status not in self.settings.release_statuses
        )

    def _entry_fenced(self) -> bool:
        return isinstance(self._entry, CurrentClaim) and self._entry.fenced

    def _request_fingerprint(self, body: bytes) -> str:
        return request_fingerprint(
            self.scope["method"],
            self.template,
            self.scope["path"],
            self.scope.get("query_string", b""),
            [
                (name, value)
                for name in self.options.fingerprint_headers
                for value in self.headers.get(name, ())
            ],
            body,
            content_type=self.headers.get("content-type", [""])[0],
            mode=self.settings.fingerprint,
        )

    async def _scope_failed(self) -> None:
        await scope_failed(self.options, self.send)

    async def _problem(self, problem: Problem, status: int, detail: str) -> None:
        await send_problem(self.send, problem, status, detail, retry_after=self.options.retry_after)


async def read_body(
    receive: Receive,
    send: Send,
    headers: dict[str, list[str]],
    settings: Settings,
    options: Options,
) -> bytes | None:
    """The whole request body, or ``None`` when the client left or the body is larger than the
    route's ``max_request_bytes`` (answered 413, whether its length was declared or not)."""
    limit = settings.max_request_bytes
    declared = headers.get("content-length", [""])[0]
    # ASCII digits only, and few enough of them for int(): the server may not have checked.
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        await _too_large(send, limit, options)
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            await _too_large(send, limit, options)
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _too_large(send: Send, limit: int, options: Options) -> None:
    await send_problem(
        send,
        Problem.TOO_LARGE,
        413,
        f"Request bodies of this route are limited to {limit} bytes.",
        retry_after=options.retry_after,
    )
