"""``GET <lookup_path>/<key>``: a caller asks what became of its key, without sending the
request again.

The answer is JSON, for the caller the key is bound to only (the same scope and credentials as
its requests): another caller is told exactly what a key never seen is told. ``?replay=true``
asks for the recorded answer itself when there is one (replayed, as a retry would get it), and
the JSON state otherwise.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from starlette.types import Scope, Send

from idempotency_mw.http._asgi import invalid_key_detail, parse_key, request_headers, send_replay
from idempotency_mw.http.caller import caller_scope, credential_binding
from idempotency_mw.http.options import Options
from idempotency_mw.http.retention import KeyAnswers
from idempotency_mw.stores.base import KeyLookup
from idempotency_mw.values.exceptions import StoreError
from idempotency_mw.values.problems import Problem, send_problem
from idempotency_mw.wire.lookup import state_json


def looked_up_key(scope: Scope, lookup_path: str) -> str | None:
    """The key named by a request's path under ``lookup_path`` (maybe empty, or invalid), or
    ``None`` when the path is not a lookup's."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    prefix = lookup_path + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


async def answer_lookup(options: Options, scope: Scope, send: Send, raw: str) -> None:
    """Answer the lookup of the key ``raw`` (from the path) for the request's caller."""
    key = parse_key(raw)
    if key is None:
        detail = invalid_key_detail("The looked-up key", raw) if raw else "Name a key."
        await send_problem(send, Problem.INVALID_KEY, 400, detail)
        return
    caller = await caller_scope(options, scope, send)
    if caller is None:
        return
    binding = credential_binding(options, scope, request_headers(scope, options.read_headers))
    assert isinstance(options.store, KeyLookup)  # checked with the options
    try:
        state = await options.store.lookup(caller, key, binding=binding)
    except StoreError:
        await send_problem(
            send,
            Problem.STORE_UNAVAILABLE,
            503,
            "The idempotency store is unavailable; look again later.",
            retry_after=options.retry_after,
        )
        return
    answers = KeyAnswers(send, oasis=False)
    if state is not None:
        answers.found(state.expires_at)
        if state.response is not None and _wants_replay(scope):
            await send_replay(answers.send, state.response)
            return
    body = json.dumps(state_json(state)).encode()
    await answers.send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await answers.send({"type": "http.response.body", "body": body})


def _wants_replay(scope: Scope) -> bool:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get("replay") == ["true"]
