"""The operator's web panel: a Starlette app to mount behind your own authentication.

It shows a store's records by status, the keys stuck in progress past their lease, and a
client journal's operations that need a person. It is read-only unless ``actions=True``; then
each action (release a stuck key; retry an operation now; mark one confirmed or failed with a
note) goes through a confirmation page whose form carries a proof that only this panel can
make, so a request that skipped the page (or came from another site) changes nothing. Every
action is logged on the ``idempotency_mw.panel`` logger. Pages are plain HTML rendered on the
server, with no script.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import logging
import secrets
import string
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from importlib.resources import files
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlencode

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from idempotency_mw.admin import (
    RecordView,
    ReleaseOutcome,
    StoreStats,
    relative_time,
    release_record,
)
from idempotency_mw.exceptions import ConfigurationError, StoreError, describe
from idempotency_mw.records import RecordStatus

if TYPE_CHECKING:
    from idempotency_mw.admin import InspectableStore
    from idempotency_mw.client import IdempotentClient, Journal, JournalEntry
    from idempotency_mw.client.attention import AttentionRow

__all__ = ["panel"]

T = TypeVar("T")
logger = logging.getLogger("idempotency_mw.panel")

_PAGE = string.Template(
    (files("idempotency_mw") / "panel_templates" / "page.html").read_text(encoding="utf-8")
)
#: Request headers whose values the panel never shows.
_SECRET_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization", "x-api-key"})
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
    limit: int = 50,
) -> Starlette:
    """The panel on ``store`` (and ``journal``, the client's, if given), as an ASGI app.

    ``client``, an :class:`~idempotency_mw.client.IdempotentClient` on ``journal`` with your
    base URL, credentials and probes, is what "retry now" sends with; without one the panel
    offers no retry. ``actions=True`` switches the actions on. Lists show at most ``limit``
    records each. The panel never closes the store, the journal or the client.
    """
    view = _Panel(store, journal, client, actions=actions, limit=limit)
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


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _when(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    return f'<span title="{moment:%Y-%m-%d %H:%M:%S} UTC">{relative_time(moment, now)}</span>'


def _table(header: Iterable[str], rows: list[list[str]], empty: str) -> str:
    """A table of cells that are HTML already (escape what goes into them)."""
    if not rows:
        return f'<p class="empty">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(name)}</th>" for name in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _shown(data: bytes | None) -> str:
    if data is None:
        return '<p class="muted">none</p>'
    text = data[:_MAX_SHOWN].decode("utf-8", "replace")
    more = f"\n… {len(data) - _MAX_SHOWN:,} more bytes" if len(data) > _MAX_SHOWN else ""
    return f"<pre>{_e(text + more)}</pre>"


def _headers(headers: Iterable[tuple[str, str]]) -> str:
    lines = [
        f"{name}: {'(hidden)' if name.lower() in _SECRET_HEADERS else value}"
        for name, value in headers
    ]
    return f"<pre>{_e(chr(10).join(lines))}</pre>" if lines else '<p class="muted">none</p>'


def _record_name(record: RecordView) -> str:
    if record.key is None:
        return f'<code>{_e(record.ref)}</code> <span class="muted">(scope and key: a digest)</span>'
    scope = f' <span class="muted">in scope</span> <code>{_e(record.scope)}</code>'
    return f"<code>{_e(record.key)}</code>{scope if record.scope else ''}"


def _status(record: RecordView) -> str:
    badges = [f'<span class="badge">{_e(record.status)}</span>']
    if record.fenced:
        badges.append('<span class="badge">effect committed</span>')
    if record.stuck:
        badges.append('<span class="badge warn">stuck: lease lapsed</span>')
    if record.expired:
        badges.append('<span class="badge">expired</span>')
    return " ".join(badges)


def _response(record: RecordView) -> str:
    if record.response_status is None:
        return "-"
    return f"{record.response_status}, {record.response_size or 0:,} bytes"


class _Panel:
    """The panel's pages; per-request state stays in the handlers."""

    def __init__(
        self,
        store: InspectableStore,
        journal: Journal | None,
        client: IdempotentClient | None,
        *,
        actions: bool,
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
        self._store = store
        self._journal = journal
        self._client = client
        self._actions = actions
        self._limit = limit
        # The proof that a form came from this panel's own confirmation page.
        self._secret = secrets.token_bytes(32)

    # --- pages ------------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        status = _status_of(request.query_params.get("status", RecordStatus.IN_PROGRESS.value))
        stats = await self._store_call(self._store.record_stats)
        in_progress = await self._store_call(
            lambda: self._store.list_records(RecordStatus.IN_PROGRESS, limit=self._limit)
        )
        listed = (
            in_progress
            if status is RecordStatus.IN_PROGRESS
            else await self._store_call(lambda: self._store.list_records(status, limit=self._limit))
        )
        stuck = [record for record in in_progress if record.stuck]
        body = [
            "<h1>Overview</h1>",
            self._stats(stats),
            '<section id="stuck"><h2>Stuck in progress past their lease</h2>',
            '<p class="muted">Each answers 409 until a retry with the same request takes it over '
            "or it is released; releasing one lets its next request run again.</p>",
            self._records(request, stuck, empty="No key is stuck.", release=True),
            "</section>",
            f'<section id="records"><h2>Records: {_e(status)}</h2>',
            self._tabs(request, status),
            self._records(request, listed, empty=f"No record is {status}.", release=False),
            f'<p class="muted">At most {self._limit} shown, the earliest lease end first.</p>',
            "</section>",
        ]
        if self._journal is not None:
            body.append(await self._attention(request))
        return self._page(request, "Overview", "".join(body))

    async def confirm_release(self, request: Request) -> Response:
        ref, version = _required(request.query_params, "ref", "version")
        record = await self._found(ref)
        if record.version != version:
            raise _Refused("The record changed since it was listed: nothing changed.", 409)
        if not record.releasable:
            raise _Refused(_NOT_RELEASABLE, 409)
        body = [
            "<h1>Release this key?</h1>",
            "<section>",
            self._details(record),
            "<p>Its next request will run the handler again. A request that settles it "
            "meanwhile is never undone.</p>",
            self._confirm_form(
                request.url_for("release"),
                {"ref": ref, "version": version},
                proof_of=("release", ref, version),
                yes="Release",
            ),
            "</section>",
        ]
        return self._page(request, "Release", "".join(body))

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
        body = [
            f"<h1>Operation {_e(entry.name)}</h1>",
            "<section>",
            "<dl>",
            f'<dt>state</dt><dd><span class="badge warn">{_e(entry.state)}</span></dd>',
            f"<dt>ref</dt><dd>{_e(entry.ref or '-')}</dd>",
            f"<dt>key digest</dt><dd><code>{_e(row.key)}</code></dd>",
            f"<dt>first sent (UTC)</dt><dd>{_e(row.first_sent or '-')}</dd>",
            "</dl>",
            "<h2>Request</h2>",
            f"<p><code>{_e(entry.method or '-')} {_e(entry.url or '')}</code></p>",
            _headers(entry.headers),
            _shown(entry.body),
            "<h2>Last answer</h2>",
            f"<p>HTTP {_e(entry.status)}</p>" if entry.status is not None else "",
            _headers(entry.response_headers),
            _shown(entry.response_body),
        ]
        if self._actions:
            links = [
                '<a class="button plain" href="'
                f'{_e(request.url_for("confirm_operation", digest=row.key, action=action))}">'
                f"{_e(label)}</a>"
                for action, label in _JOURNAL_ACTIONS.items()
                if action != "retry" or self._client is not None
            ]
            body.append(f'<div class="actions">{"".join(links)}</div>')
        body.append("</section>")
        return self._page(request, entry.name, "".join(body))

    async def confirm_operation(self, request: Request) -> Response:
        digest, action = request.path_params["digest"], self._action(request)
        _, entry = await self._entry(digest)
        what = {
            "retry": "Send it again now, under its key, with the client's rules?",
            "confirmed": "Mark it confirmed: it took effect, and it is never sent again?",
            "failed": (
                "Mark it failed: settled as refused (undo any effect it had yourself), and it "
                "is never sent again?"
            ),
        }[action]
        fields = {} if action == "retry" else {"note": ""}
        body = [
            f"<h1>{_e(_JOURNAL_ACTIONS[action])}: {_e(entry.name)}</h1>",
            "<section>",
            f"<p>{_e(what)}</p>",
            self._confirm_form(
                request.url_for("act_on_operation", digest=digest, action=action),
                fields,
                proof_of=(action, digest),
                yes=_JOURNAL_ACTIONS[action],
            ),
            "</section>",
        ]
        return self._page(request, "Confirm", "".join(body))

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

    # --- parts ------------------------------------------------------------------------------

    def _stats(self, stats: StoreStats) -> str:
        counts: list[tuple[str, int | None]] = [
            (str(status).replace("_", " "), count) for status, count in stats.by_status.items()
        ]
        counts += [
            ("fenced (effect committed)", stats.fenced),
            ("expired, awaiting the purge", stats.expired),
        ]
        tiles = "".join(
            f'<div class="tile"><b>{"-" if count is None else f"{count:,}"}</b>'
            f"<span>{_e(label)}</span></div>"
            for label, count in counts
        )
        size = "" if stats.size_bytes is None else f"; {stats.size_bytes:,} bytes"
        return (
            f'<section id="stats"><h2>Records by status</h2><div class="tiles">{tiles}</div>'
            f'<p class="muted">{stats.total:,} records in all{size}; '
            f"store clock {stats.now:%Y-%m-%d %H:%M:%S} UTC.</p></section>"
        )

    def _tabs(self, request: Request, current: RecordStatus) -> str:
        links = [
            f'<a class="{"on" if status is current else ""}" '
            f'href="{_e(request.url_for("home"))}?{urlencode({"status": status.value})}">'
            f"{_e(status)}</a>"
            for status in RecordStatus
        ]
        return f'<nav class="tabs">{"".join(links)}</nav>'

    def _records(
        self, request: Request, records: list[RecordView], *, empty: str, release: bool
    ) -> str:
        header = ["record", "status", "lease", "expires", "response"]
        if release and self._actions:
            header.append("")
        rows = []
        for record in records:
            row = [
                _record_name(record),
                _status(record),
                _when(record.lease_expires_at, record.now),
                _when(record.expires_at, record.now),
                _response(record),
            ]
            if release and self._actions and not record.releasable:
                # As the CLI refuses it: a retry would run a committed effect again.
                row.append('<span class="muted">effect committed</span>')
            elif release and self._actions:
                query = urlencode({"ref": record.ref, "version": record.version})
                url = f"{request.url_for('confirm_release')}?{query}"
                row.append(f'<a class="button plain" href="{_e(url)}">Release…</a>')
            rows.append(row)
        return _table(header, rows, empty)

    def _details(self, record: RecordView) -> str:
        rows = [
            ("record", _record_name(record)),
            ("status", _status(record)),
            ("request hash", f"<code>{_e(record.request_hash)}</code>"),
            ("created", _when(record.created_at, record.now)),
            ("lease", _when(record.lease_expires_at, record.now)),
            ("expires", _when(record.expires_at, record.now)),
            ("response", _e(_response(record))),
        ]
        return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"

    async def _attention(self, request: Request) -> str:
        rows = [
            [
                f'<span class="badge warn">{_e(row.state)}</span>',
                _e(row.name),
                _e(row.ref or "-"),
                _e(row.status or "-"),
                _e(row.first_sent or "-"),
                '<a class="button plain" '
                f'href="{_e(request.url_for("operation", digest=row.key))}">open</a>',
            ]
            for row, _ in (await self._needing_attention())[: self._limit]
        ]
        header = ["state", "operation", "ref", "last status", "first sent (UTC)", ""]
        return (
            '<section id="attention"><h2>Operations that need attention</h2>'
            + _table(header, rows, "No operation needs attention.")
            + "</section>"
        )

    def _confirm_form(
        self, action: Any, fields: dict[str, str], *, proof_of: tuple[str, ...], yes: str
    ) -> str:
        if not self._actions:
            return '<p class="notice warn">The panel is read-only: actions are switched off.</p>'
        hidden = "".join(
            f'<input type="hidden" name="{_e(name)}" value="{_e(value)}">'
            for name, value in fields.items()
            if name != "note"
        )
        note = (
            '<p><label for="note">Note (journaled with it)</label>'
            '<textarea id="note" name="note" required></textarea></p>'
            if "note" in fields
            else ""
        )
        return (
            f'<form method="post" action="{_e(action)}">{hidden}'
            f'<input type="hidden" name="proof" value="{self._proof(proof_of)}">{note}'
            '<div class="actions">'
            f'<button class="danger" type="submit" name="decision" value="yes">{_e(yes)}</button>'
            '<button class="plain" type="submit" name="decision" value="no">Cancel</button>'
            "</div></form>"
        )

    def _page(self, request: Request, title: str, body: str, status_code: int = 200) -> Response:
        page = _PAGE.substitute(
            title=_e(title),
            home=_e(request.url_for("home")),
            store=_e(repr(self._store)),
            mode="actions on" if self._actions else "read-only",
            body=body,
        )
        return HTMLResponse(page, status_code=status_code, headers=_HEADERS)

    def _result(self, request: Request, kind: str, message: str, status_code: int) -> Response:
        back = f'<p><a class="button plain" href="{_e(request.url_for("home"))}">Back</a></p>'
        body = f'<div class="notice {kind}">{_e(message)}</div>{back}'
        return self._page(request, "Done" if kind == "ok" else "Nothing changed", body, status_code)

    # --- checks and calls -------------------------------------------------------------------

    def _proof(self, parts: tuple[str, ...]) -> str:
        message = "\x00".join(parts).encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _check_decision(self, form: dict[str, str], parts: tuple[str, ...]) -> None:
        if not self._actions:
            raise _Refused("The panel is read-only: nothing changed.", 403)
        if not hmac.compare_digest(form.get("proof", ""), self._proof(parts)):
            raise _Refused("This action was not confirmed on its page: nothing changed.", 403)
        if form.get("decision") != "yes":
            raise _Refused("Cancelled: nothing changed.", 200)

    async def _form(self, request: Request) -> dict[str, str]:
        # Parsed here (urlencoded only): the panel needs no multipart parser.
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
