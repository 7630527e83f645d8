"""The operator's web panel: a Starlette app to mount behind your own authentication.

It shows a store's records by status, the keys stuck in progress past their lease, the
settings of the store's server that can lose records (``idempotency-mw check``), and a client
journal's operations that need a person. It is read-only unless ``actions=True``; then
each action (release a stuck key; retry an operation now; mark one confirmed or failed with a
note) goes through a confirmation page whose form carries a proof made with the operator's
secret, so a request that skipped the page (or came from another site) changes nothing, and a
page one worker served is accepted by every other. Every action is logged on the
``idempotency_mw.operator.panel`` logger. Pages are plain HTML rendered on the server from the
package's Jinja2 templates (``templates/panel``), with no script.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_mw.operator.admin import ReleaseOutcome, relative_time, release_record
from idempotency_mw.stores.checks import findings
from idempotency_mw.values.exceptions import ConfigurationError, StoreError, describe, install_extra
from idempotency_mw.values.records import RecordStatus, RecordView
from idempotency_mw.wire.credentials import is_credential

if TYPE_CHECKING:
    from starlette.templating import Jinja2Templates

    from idempotency_mw.client import IdempotentClient, Journal, JournalEntry
    from idempotency_mw.client.attention import AttentionRow
    from idempotency_mw.operator.admin import InspectableStore

__all__ = ["panel"]

T = TypeVar("T")
logger = logging.getLogger("idempotency_mw.operator.panel")

#: Pages are never framed by another site (a click on a confirmation page is the operator's),
#: run no script, are not cached, and send no referrer (URLs name records).
_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}
_MAX_FORM = 16 * 1024
_MAX_SHOWN = 8 * 1024
#: Why a record is not offered for release (the CLI refuses it too, without --force).
_NOT_RELEASABLE = (
    "Not released: the record is settled, or its effect was committed (a fenced commit), "
    "and a release would let a retry run it again."
)
_JOURNAL_ACTIONS = {"retry": "Retry now", "confirmed": "Mark confirmed", "failed": "Mark failed"}
#: The shortest secret accepted: shorter ones can be guessed.
_MIN_SECRET_BYTES = 16
#: Keeps the panel's proofs apart from whatever else the operator signs with the same secret.
_PROOF_DOMAIN = b"idempotency-mw panel proof\x00"


class _Refused(Exception):
    """An input the panel will not act on: the page to show, and its status code."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def panel(
    store: InspectableStore,
    *,
    journal: Journal | None = None,
    client: IdempotentClient | None = None,
    actions: bool = False,
    secret: str | bytes | None = None,
    limit: int = 50,
) -> Starlette:
    """The panel on ``store`` (and ``journal``, the client's, if given), as an ASGI app.

    ``client``, an :class:`~idempotency_mw.client.IdempotentClient` on ``journal`` with your
    base URL, credentials and probes, is what "retry now" sends with; without one the panel
    offers no retry. ``actions=True`` switches the actions on; it needs ``secret`` (at least 16
    bytes, the same in every worker and process that serves the panel), with which each
    confirmation page proves its form. Lists show at most ``limit`` records each. The panel
    never closes the store, the journal or the client. It needs the ``panel`` extra (Jinja2):
    without it, a :class:`ModuleNotFoundError` names the extra.
    """
    view = _Panel(store, journal, client, actions=actions, secret=secret, limit=limit)
    return Starlette(
        routes=[
            Route("/", view.home, name="home"),
            Route("/release", view.confirm_release, name="confirm_release"),
            Route("/release", view.release, methods=["POST"], name="release"),
            Route("/operations/{digest}", view.operation, name="operation"),
            Route(
                "/operations/{digest}/{action}", view.confirm_operation, name="confirm_operation"
            ),
            Route(
                "/operations/{digest}/{action}",
                view.act_on_operation,
                methods=["POST"],
                name="act_on_operation",
            ),
        ],
        exception_handlers={_Refused: view.refused},
    )


class _Panel:
    """The panel's pages; per-request state stays in the handlers."""

    def __init__(
        self,
        store: InspectableStore,
        journal: Journal | None,
        client: IdempotentClient | None,
        *,
        actions: bool,
        secret: str | bytes | None,
        limit: int,
    ) -> None:
        from idempotency_mw.stores.base import Inspectable

        if not isinstance(store, Inspectable):
            raise ConfigurationError(
                f"the panel needs a store it can inspect (SQLStore, RedisStore, MemoryStore, or "
                f"one that implements Inspectable); {store!r} does not"
            )
        if limit < 1:
            raise ConfigurationError("the panel's limit must be at least 1")
        key = secret.encode() if isinstance(secret, str) else secret
        if actions and (key is None or len(key) < _MIN_SECRET_BYTES):
            # The store holds no secret (its repr is on every page), and a random one per
            # instance would refuse a page another worker served: the operator gives it.
            raise ConfigurationError(
                f"panel(actions=True) needs secret=, at least {_MIN_SECRET_BYTES} bytes and the "
                "same in every worker (e.g. read from an environment variable): it proves that "
                "a form came from the panel's own confirmation page"
            )
        self._store = store
        self._journal = journal
        self._client = client
        self._actions = actions
        self._limit = limit
        self._secret = key or b""
        self._templates = _templates()

    # --- pages ------------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        status = _status_of(request.query_params.get("status", RecordStatus.IN_PROGRESS.value))
        stats = await self._store_call(self._store.record_stats)
        found = await self._store_call(lambda: findings(self._store))
        in_progress = await self._store_call(
            lambda: self._store.list_records(RecordStatus.IN_PROGRESS, limit=self._limit)
        )
        listed = (
            in_progress
            if status is RecordStatus.IN_PROGRESS
            else await self._store_call(lambda: self._store.list_records(status, limit=self._limit))
        )
        attention = None
        if self._journal is not None:
            attention = [row for row, _ in (await self._needing_attention())[: self._limit]]
        return self._render(
            request,
            "overview.html",
            stats=stats,
            findings=found,
            stuck=[record for record in in_progress if record.stuck],
            status=status,
            statuses=list(RecordStatus),
            listed=listed,
            limit=self._limit,
            attention=attention,
        )

    async def confirm_release(self, request: Request) -> Response:
        ref, version = _required(request.query_params, "ref", "version")
        record = await self._found(ref)
        if record.version != version:
            raise _Refused("The record changed since it was listed: nothing changed.", 409)
        if not record.releasable:
            raise _Refused(_NOT_RELEASABLE, 409)
        proof = self._proof(("release", ref, version))
        return self._render(request, "release.html", record=record, proof=proof)

    async def release(self, request: Request) -> Response:
        form = await self._form(request)
        ref, version = _required(form, "ref", "version")
        self._check_decision(form, ("release", ref, version))
        record = await self._found(ref)
        outcome = ReleaseOutcome.CHANGED
        if record.version == version:
            result = await self._store_call(
                lambda: release_record(self._store, record, force=False)
            )
            outcome = result.outcome
        logger.warning("panel: release of %s: %s", _digest(ref), outcome.value)
        messages = {
            ReleaseOutcome.RELEASED: ("ok", "Released: the key's next request runs again."),
            ReleaseOutcome.REFUSED: ("warn", _NOT_RELEASABLE),
            ReleaseOutcome.CHANGED: (
                "warn",
                "Not released: the record changed since it was shown (a request settled or "
                "took it). Nothing changed.",
            ),
        }
        kind, message = messages.get(outcome, ("warn", "Nothing changed."))
        return self._result(request, kind, message, 200 if kind == "ok" else 409)

    async def operation(self, request: Request) -> Response:
        row, entry = await self._entry(request.path_params["digest"])
        offered = {
            action: label
            for action, label in _JOURNAL_ACTIONS.items()
            if action != "retry" or self._client is not None
        }
        return self._render(
            request, "operation.html", row=row, entry=entry, offered=offered, why=_why(entry)
        )

    async def confirm_operation(self, request: Request) -> Response:
        digest, action = request.path_params["digest"], self._action(request)
        _, entry = await self._entry(digest)
        return self._render(
            request,
            "confirm.html",
            entry=entry,
            digest=digest,
            action=action,
            label=_JOURNAL_ACTIONS[action],
            proof=self._proof((action, digest)),
        )

    async def act_on_operation(self, request: Request) -> Response:
        digest, action = request.path_params["digest"], self._action(request)
        form = await self._form(request)
        self._check_decision(form, (action, digest))
        _, entry = await self._entry(digest)
        if action == "retry":
            kind, message = await self._retry(entry)
        else:
            from idempotency_mw.client import OperationState
            from idempotency_mw.client.journals import resolve

            note = form.get("note", "").strip()
            if not note:
                raise _Refused("A note is required: say why. Nothing changed.")
            journal = self._journal
            assert journal is not None
            state = OperationState(action)
            try:
                await _journal_call(resolve, journal, entry.key, state, note)
            except ConfigurationError as exc:
                raise _Refused(f"Not marked: {exc}. Nothing changed.", 409) from exc
            kind, message = "ok", f"Marked {action}; the note is journaled with it."
        logger.warning("panel: %s of operation %s: %s", action, digest, message)
        return self._result(request, kind, message, 200)

    async def refused(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refused)
        return self._result(request, "warn", str(exc), exc.status_code)

    def _render(
        self, request: Request, template: str, status_code: int = 200, **context: Any
    ) -> Response:
        context.update(store=repr(self._store), actions=self._actions)
        return self._templates.TemplateResponse(
            request, template, context, status_code=status_code, headers=_HEADERS
        )

    def _result(self, request: Request, kind: str, message: str, status_code: int) -> Response:
        return self._render(request, "result.html", status_code, kind=kind, message=message)

    # --- checks and calls -------------------------------------------------------------------

    def _proof(self, parts: tuple[str, ...]) -> str:
        message = _PROOF_DOMAIN + "\x00".join(parts).encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _check_decision(self, form: dict[str, str], parts: tuple[str, ...]) -> None:
        if not self._actions:
            raise _Refused("The panel is read-only: nothing changed.", 403)
        if not hmac.compare_digest(form.get("proof", ""), self._proof(parts)):
            raise _Refused("This action was not confirmed on its page: nothing changed.", 403)
        if form.get("decision") != "yes":
            raise _Refused("Cancelled: nothing changed.", 200)

    async def _form(self, request: Request) -> dict[str, str]:
        # Starlette's request.form() needs python-multipart even for urlencoded forms, and caps
        # each field rather than the body: the body read up to a cap, then the stdlib's parser.
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > _MAX_FORM:
                raise _Refused("The form is too large.", 413)
        try:
            fields = parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Refused("The form could not be read.") from exc
        return {name: values[-1] for name, values in fields.items()}

    def _action(self, request: Request) -> str:
        action: str = request.path_params["action"]
        if action not in _JOURNAL_ACTIONS or (action == "retry" and self._client is None):
            raise _Refused(f"No such action: {action!r}.", 404)
        return action

    async def _found(self, ref: str) -> RecordView:
        record: RecordView | None = await self._store_call(lambda: self._store.find_record(ref))
        if record is None:
            raise _Refused("No such record (it was settled and deleted, or expired).", 404)
        return record

    async def _needing_attention(self) -> list[tuple[AttentionRow, JournalEntry]]:
        """The journal's operations that need a person: each as listed, and as journaled."""
        from idempotency_mw.client.attention import attention_rows
        from idempotency_mw.client.journals import needing_attention
        from idempotency_mw.client.protocol import key_digest

        if self._journal is None:
            raise _Refused("The panel was given no journal.", 404)

        def read(journal: Journal) -> list[tuple[AttentionRow, JournalEntry]]:
            # Two reads of the journal: a pair whose operation changed between them is left out.
            pairs = zip(attention_rows(journal), needing_attention(journal), strict=False)
            return [(row, entry) for row, entry in pairs if row.key == key_digest(entry.key)]

        return await _journal_call(read, self._journal)

    async def _entry(self, digest: str) -> tuple[AttentionRow, JournalEntry]:
        for row, entry in await self._needing_attention():
            if hmac.compare_digest(row.key, digest):
                return row, entry
        raise _Refused("No such operation needs attention (it may be resolved already).", 404)

    async def _retry(self, entry: JournalEntry) -> tuple[str, str]:
        from idempotency_mw.client import OperationError

        client = self._client
        assert client is not None
        if entry.method is None or entry.url is None:
            raise _Refused("It was never sent: there is no request to send again.", 409)
        operation = entry.operation
        try:
            response = await client.send(
                operation, entry.method, entry.url, headers=dict(entry.headers), content=entry.body
            )
        except OperationError as exc:
            return "warn", f"Sent, without a final answer: {type(exc).__name__}: {exc}"
        except Exception as exc:  # the server or the network: shown, never a 500
            return "warn", f"Not settled: {describe(exc)}"
        return "ok", f"Sent again: HTTP {response.status_code}; the journal holds the answer."

    async def _store_call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except ConfigurationError as exc:
            raise _Refused(str(exc)) from exc
        except StoreError as exc:
            raise _Refused(f"The store failed: {exc}", 503) from exc


async def _journal_call(call: Callable[..., T], *args: Any) -> T:
    """A journal's blocking call, in a worker thread."""
    try:
        return await anyio.to_thread.run_sync(call, *args)
    except ConfigurationError:
        raise
    except Exception as exc:
        # Journals raise their drivers' errors as they are (SQLAlchemy's, redis-py's): a page
        # that says the journal failed, never a 500.
        raise _Refused(f"The journal failed: {describe(exc)}", 503) from exc


def _templates() -> Jinja2Templates:
    """The panel's pages, escaped as HTML; a clear error without the [panel] extra."""
    try:
        import jinja2
        from starlette.templating import Jinja2Templates
    except ImportError as exc:
        message = f"the panel needs jinja2: {install_extra('panel')}"
        raise ModuleNotFoundError(message, name="jinja2") from exc
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("idempotency_mw", "templates/panel"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals["relative_time"] = relative_time
    env.filters.update(thousands="{:,}".format, redacted=_redacted, excerpt=_excerpt)
    return Jinja2Templates(env=env)


def _redacted(headers: Iterable[tuple[str, str]]) -> list[str]:
    """Header lines to show, the values of credentials hidden."""
    return [f"{name}: {'(hidden)' if is_credential(name) else value}" for name, value in headers]


def _excerpt(data: bytes) -> str:
    """A body as text, cut at :data:`_MAX_SHOWN` bytes."""
    text = data[:_MAX_SHOWN].decode("utf-8", "replace")
    more = f"\n… {len(data) - _MAX_SHOWN:,} more bytes" if len(data) > _MAX_SHOWN else ""
    return text + more


def _why(entry: JournalEntry) -> str:
    """Why an operation waits for a person, in the words of the client that stopped it."""
    from idempotency_mw.client import OperationState
    from idempotency_mw.client.protocol import confirmation_reason

    if entry.state is OperationState.NEEDS_CONFIRMATION:
        reason = confirmation_reason(entry, time.time())
        return (
            f"its outcome is unknown and {reason}, so the client will not send it again "
            "blindly, and no probe was configured to look it up. Check whether it took "
            "effect, then mark it confirmed or failed"
        )
    return (
        "a saga gave up on it (a step it could not settle, or a compensation that kept "
        "failing). Undo or finish what it did, then mark it"
    )


def _status_of(value: str) -> RecordStatus:
    try:
        return RecordStatus(value)
    except ValueError as exc:
        raise _Refused(f"No such status: {value!r}.") from exc


def _required(fields: Any, *names: str) -> list[str]:
    values = [fields.get(name) for name in names]
    missing = [name for name, value in zip(names, values, strict=True) if not value]
    if missing:
        raise _Refused(f"Missing: {', '.join(missing)}.")
    return [str(value) for value in values]


def _digest(ref: str) -> str:
    return hashlib.sha256(ref.encode("utf-8", "surrogatepass")).hexdigest()[:12]
