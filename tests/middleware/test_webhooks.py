"""Webhooks received exactly once: each route reads its sender's own message id (a header, or a
field of the JSON body), and a re-delivery, newly timestamped and signed, is the same request.

The senders' signatures are real: the ``standardwebhooks`` library signs Standard Webhooks
deliveries, Stripe's and GitHub's are made as their documentation describes (an HMAC-SHA256 of
the timestamped payload, of the body), and the app verifies them with ``standardwebhooks``,
``stripe.Webhook.construct_event`` and ``hmac``, in a FastAPI dependency.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import anyio
import httpx
import pytest
import stripe
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from standardwebhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from idempotency_mw import (
    ConfigurationError,
    IdempotencyMiddleware,
    RouteOptions,
    Store,
    from_header,
    from_json,
    idempotent,
)
from tests.support.apps import client_for, started

pytestmark = pytest.mark.anyio

STANDARD_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
STRIPE_SECRET = "whsec_stripe_endpoint_secret"
GITHUB_SECRET = "It's a Secret to Everybody"


async def standard_event(request: Request) -> Any:
    try:
        return Webhook(STANDARD_SECRET).verify(await request.body(), dict(request.headers))
    except WebhookVerificationError as exc:
        raise HTTPException(401, "invalid signature") from exc


async def stripe_event(request: Request, stripe_signature: str = Header("")) -> Any:
    try:
        return stripe.Webhook.construct_event(await request.body(), stripe_signature, STRIPE_SECRET)
    except stripe.SignatureVerificationError as exc:
        raise HTTPException(401, "invalid signature") from exc


async def github_event(request: Request, x_hub_signature_256: str = Header("")) -> Any:
    body = await request.body()
    digest = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(f"sha256={digest}", x_hub_signature_256):
        raise HTTPException(401, "invalid signature")
    return json.loads(body)


def webhook_app(store: Store, **options: Any) -> FastAPI:
    """A receiver of Standard Webhooks (keyed by ``webhook-id``), Stripe (by the event's ``id``
    in the body) and GitHub (by ``X-GitHub-Delivery``, through ``routes=``), each delivery's
    signature verified in a dependency; ``app.state.effects`` lists what each delivery did."""
    app = FastAPI()
    effects: list[tuple[str, str]] = []
    app.state.effects = effects
    #: Awaited by an endpoint before its effect, when a test holds it there.
    app.state.before_effect = None

    async def effect(source: str, what: str) -> dict[str, Any]:
        hold: Callable[[], Awaitable[None]] | None = app.state.before_effect
        if hold is not None:
            await hold()
        effects.append((source, what))
        return {"effect": len(effects), "of": what}

    @app.post("/webhooks/standard")
    @idempotent(key=from_header("webhook-id"), required=True)
    async def standard_hook(event: Annotated[Any, Depends(standard_event)]) -> dict[str, Any]:
        return await effect("standard", event["type"])

    @app.post("/webhooks/other-sender")
    @idempotent(key=from_header("webhook-id"), required=True)
    async def other_sender(event: Annotated[Any, Depends(standard_event)]) -> dict[str, Any]:
        return await effect("other", event["type"])

    @app.post("/webhooks/stripe")
    @idempotent(key=from_json("id"), required=True)
    async def stripe_hook(event: Annotated[Any, Depends(stripe_event)]) -> dict[str, Any]:
        return await effect("stripe", event["id"])

    # A route that cannot be decorated: its settings come from routes=, and 401 (the
    # dependency's refusal, which this route's door cannot tell from the endpoint's) releases.
    @app.post("/webhooks/github")
    async def github_hook(event: Annotated[Any, Depends(github_event)]) -> dict[str, Any]:
        return await effect("github", event["action"])

    routes: dict[str, RouteOptions] = {
        "POST /webhooks/github": {
            "key": from_header("X-GitHub-Delivery"),
            "required": True,
            "release_statuses": {401},
        }
    }
    app.add_middleware(IdempotencyMiddleware, store=store, routes=routes, **options)
    return app


def standard_delivery(
    message_id: str, payload: bytes, at: datetime, *, secret: str = STANDARD_SECRET
) -> dict[str, str]:
    """The headers of one Standard Webhooks delivery attempt, signed by the reference library."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(secret).sign(message_id, at, payload),
    }


def stripe_delivery(payload: bytes, at: datetime, *, secret: str = STRIPE_SECRET) -> dict[str, str]:
    """The headers of one Stripe delivery attempt: ``t=<timestamp>,v1=<HMAC-SHA256 of
    "<timestamp>.<payload>">``, as Stripe's documentation describes its signature."""
    timestamp = int(at.timestamp())
    signed = f"{timestamp}.".encode() + payload
    signature = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return {"content-type": "application/json", "stripe-signature": f"t={timestamp},v1={signature}"}


def github_delivery(delivery: str, payload: bytes) -> dict[str, str]:
    """The headers of one GitHub delivery: ``X-Hub-Signature-256`` is the HMAC-SHA256 of the
    body, in hex, after ``sha256=``."""
    digest = hmac.new(GITHUB_SECRET.encode(), payload, hashlib.sha256).hexdigest()
    return {
        "content-type": "application/json",
        "x-github-delivery": delivery,
        "x-github-event": "issues",
        "x-hub-signature-256": f"sha256={digest}",
    }


def attempts(count: int) -> list[datetime]:
    """When a sender made each of ``count`` attempts: 20 seconds apart (within the five
    minutes a signature's timestamp is accepted), the last one now."""
    now = datetime.now(UTC)
    return [now - timedelta(seconds=20 * (count - 1 - n)) for n in range(count)]


STANDARD_PAYLOAD = b'{"type": "invoice.paid", "data": {"invoice": "in_1"}}'


def stripe_payload(event_id: str) -> bytes:
    return json.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": "payment_intent.succeeded",
            "data": {"object": {"id": "pi_1", "object": "payment_intent"}},
        }
    ).encode()


@pytest.mark.parametrize("lifespan", [True, False], ids=["lifespan", "no-lifespan"])
async def test_standard_webhooks_redeliveries_get_the_first_answer(
    backend_store: Store, lifespan: bool
) -> None:
    app = webhook_app(backend_store)
    async with started(app, lifespan) as client:
        answers = [
            await client.post(
                "/webhooks/standard",
                content=STANDARD_PAYLOAD,
                headers=standard_delivery("msg_2Lh", STANDARD_PAYLOAD, at),
            )
            for at in attempts(4)
        ]
    assert app.state.effects == [("standard", "invoice.paid")]
    assert [a.status_code for a in answers] == [200] * 4
    assert {a.content for a in answers} == {b'{"effect":1,"of":"invoice.paid"}'}
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None] + ["true"] * 3
    # The same headers too, but for the replay's own (what it is, until when it is kept).
    own = {"idempotent-replayed", "idempotency-key-expires"}
    assert (
        len({frozenset((k, v) for k, v in a.headers.items() if k not in own) for a in answers}) == 1
    )


async def test_concurrent_deliveries_of_one_message_run_once(backend_store: Store) -> None:
    app = webhook_app(backend_store)
    answers: list[httpx.Response] = []
    entered = 0
    all_in = anyio.Event()

    async def hold() -> None:
        # The first delivery's effect waits until every other delivery was answered (or,
        # were one let through, until it got here too).
        nonlocal entered
        entered += 1
        if entered + len(answers) == 8:
            all_in.set()
        await all_in.wait()

    async def deliver(client: httpx.AsyncClient, at: datetime) -> None:
        answer = await client.post(
            "/webhooks/standard",
            content=STANDARD_PAYLOAD,
            headers=standard_delivery("msg_burst", STANDARD_PAYLOAD, at),
        )
        answers.append(answer)
        if entered + len(answers) == 8:
            all_in.set()

    app.state.before_effect = hold
    async with client_for(app) as client:
        async with anyio.create_task_group() as group:
            for at in attempts(8):
                group.start_soon(deliver, client, at)
        later = await client.post(
            "/webhooks/standard",
            content=STANDARD_PAYLOAD,
            headers=standard_delivery("msg_burst", STANDARD_PAYLOAD, datetime.now(UTC)),
        )
    assert app.state.effects == [("standard", "invoice.paid")]
    ran = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert len(ran) == 1
    assert [a.status_code for a in refused] == [409] * 7
    assert all(
        a.headers["retry-after"] and a.json()["type"].endswith(":in-progress") for a in refused
    )
    assert later.headers["idempotent-replayed"] == "true"
    assert later.content == ran[0].content


@pytest.mark.parametrize("lifespan", [True, False], ids=["lifespan", "no-lifespan"])
@pytest.mark.parametrize(
    "forged_payload",
    [STANDARD_PAYLOAD, b'{"type": "invoice.voided", "data": {"invoice": "in_1"}}'],
    ids=["same-body", "other-body"],
)
async def test_a_forged_delivery_never_blocks_the_genuine_one(
    store: Store, lifespan: bool, forged_payload: bytes
) -> None:
    app = webhook_app(store)
    now = datetime.now(UTC)
    async with started(app, lifespan) as client:
        forged = await client.post(
            "/webhooks/standard",
            content=forged_payload,
            headers=standard_delivery(
                "msg_guessed", forged_payload, now, secret="whsec_bm90IHRoZSBzZW5kZXIncw=="
            ),
        )
        genuine = await client.post(
            "/webhooks/standard",
            content=STANDARD_PAYLOAD,
            headers=standard_delivery("msg_guessed", STANDARD_PAYLOAD, now),
        )
    assert forged.status_code == 401
    assert genuine.status_code == 200, genuine.text
    assert "idempotent-replayed" not in genuine.headers
    assert app.state.effects == [("standard", "invoice.paid")]


@pytest.mark.parametrize("lifespan", [True, False], ids=["lifespan", "no-lifespan"])
async def test_a_forged_delivery_to_a_route_of_routes_never_blocks_the_genuine_one(
    store: Store, lifespan: bool
) -> None:
    app = webhook_app(store)
    payload = b'{"action": "opened"}'
    async with started(app, lifespan) as client:
        forged = await client.post(
            "/webhooks/github",
            content=payload,
            headers={**github_delivery("d-1", payload), "x-hub-signature-256": "sha256=00"},
        )
        genuine = await client.post(
            "/webhooks/github", content=payload, headers=github_delivery("d-1", payload)
        )
    assert forged.status_code == 401
    assert genuine.status_code == 200, genuine.text
    assert app.state.effects == [("github", "opened")]


async def test_stripe_events_keyed_by_their_body_id(store: Store) -> None:
    app = webhook_app(store)
    first, second = stripe_payload("evt_1"), stripe_payload("evt_2")
    async with client_for(app) as client:
        answers = [
            await client.post(
                "/webhooks/stripe", content=payload, headers=stripe_delivery(payload, at)
            )
            for payload, at in zip([first, second, first], attempts(3), strict=True)
        ]
    assert app.state.effects == [("stripe", "evt_1"), ("stripe", "evt_2")]
    assert [a.status_code for a in answers] == [200] * 3
    assert answers[2].headers["idempotent-replayed"] == "true"
    assert answers[2].content == answers[0].content


async def test_github_deliveries_with_their_own_ids_are_two_requests(store: Store) -> None:
    app = webhook_app(store)
    payload = b'{"action": "opened"}'
    async with client_for(app) as client:
        answers = [
            await client.post(
                "/webhooks/github", content=payload, headers=github_delivery(d, payload)
            )
            for d in ("d-1", "d-2", "d-1")
        ]
    assert app.state.effects == [("github", "opened")] * 2
    assert [a.json()["effect"] for a in answers] == [1, 2, 1]
    assert answers[2].headers["idempotent-replayed"] == "true"


async def test_one_id_on_two_routes_is_two_requests(store: Store) -> None:
    # Two senders may use the same message id: a route that reads its own key keeps its keys.
    app = webhook_app(store)
    headers = standard_delivery("msg_1", STANDARD_PAYLOAD, datetime.now(UTC))
    async with client_for(app) as client:
        answers = [
            await client.post(path, content=STANDARD_PAYLOAD, headers=headers)
            for path in ("/webhooks/standard", "/webhooks/other-sender")
        ]
    assert [a.status_code for a in answers] == [200, 200]
    assert app.state.effects == [("standard", "invoice.paid"), ("other", "invoice.paid")]


@pytest.mark.parametrize(
    ("path", "content", "headers", "problem"),
    [
        ("/webhooks/standard", STANDARD_PAYLOAD, {}, "missing-key"),
        ("/webhooks/standard", STANDARD_PAYLOAD, {"webhook-id": "a b"}, "invalid-key"),
        ("/webhooks/stripe", b'{"object": "event"}', {}, "missing-key"),
        ("/webhooks/stripe", b'{"id": null}', {}, "missing-key"),
        ("/webhooks/stripe", b"", {}, "missing-key"),
        ("/webhooks/stripe", b"id=evt_1", {}, "invalid-key"),
        ("/webhooks/stripe", b'{"id": {"nested": 1}}', {}, "invalid-key"),
        ("/webhooks/stripe", b'{"id": "' + b"x" * 256 + b'"}', {}, "invalid-key"),
        ("/webhooks/stripe", b"[" * 100_000, {}, "invalid-key"),
        ("/webhooks/github", b"{}", {}, "missing-key"),
    ],
)
async def test_a_delivery_without_a_usable_id_is_a_400_problem(
    store: Store, path: str, content: bytes, headers: dict[str, str], problem: str
) -> None:
    app = webhook_app(store)
    async with client_for(app) as client:
        answer = await client.post(path, content=content, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith(f":{problem}")
    assert app.state.effects == []


async def test_a_json_key_not_required_runs_without_a_key(store: Store) -> None:
    runs: list[bytes] = []
    app = FastAPI()

    @app.post("/events")
    @idempotent(key=from_json("data.object.id"))
    async def events(request: Request) -> dict[str, int]:
        runs.append(await request.body())
        return {"run": len(runs)}

    app.add_middleware(IdempotencyMiddleware, store=store)
    keyed = b'{"data": {"object": {"id": 42}}}'
    async with client_for(app) as client:
        answers = [
            await client.post("/events", content=content)
            for content in (b'{"data": {}}', b'{"data": {}}', keyed, keyed)
        ]
    assert [a.json()["run"] for a in answers] == [1, 2, 3, 3]
    assert runs == [b'{"data": {}}', b'{"data": {}}', keyed]


async def test_the_schema_names_each_routes_key(store: Store) -> None:
    app = webhook_app(store)
    async with client_for(app) as client:
        schema = (await client.get("/openapi.json")).json()

    def headers(path: str) -> dict[str, bool]:
        parameters = schema["paths"][path]["post"]["parameters"]
        return {p["name"]: p["required"] for p in parameters if p["in"] == "header"}

    assert headers("/webhooks/standard")["webhook-id"] is True
    assert headers("/webhooks/github")["X-GitHub-Delivery"] is True
    assert "Idempotency-Key" not in headers("/webhooks/stripe")
    assert schema["paths"]["/webhooks/stripe"]["post"]["x-idempotency"]["key_field"] == "id"
    assert "key_field" not in schema["paths"]["/webhooks/standard"]["post"]["x-idempotency"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: from_header("webhook-signature"),
        lambda: from_header("Stripe-Signature"),
        lambda: from_header("not a header"),
        lambda: from_json("data..id"),
        lambda: from_json(""),
    ],
)
def test_a_key_source_that_cannot_work_is_refused_at_start_up(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigurationError):
        make()


@pytest.mark.parametrize("option", ["credential_headers", "fingerprint_headers"])
def test_a_per_attempt_header_is_never_a_credential_or_fingerprinted(
    store: Store, option: str
) -> None:
    # Each re-delivery signs anew: bound to its signature, every re-delivery would be a 409.
    given: dict[str, Any] = {option: ["Webhook-Signature"]}
    with pytest.raises(ConfigurationError, match="webhook-signature"):
        IdempotencyMiddleware(FastAPI(), store=store, **given)


async def standard_sender(event: Annotated[Any, Depends(standard_event)]) -> str:
    return "billing-sender"


async def test_a_scope_from_the_verifying_dependency_replays_to_the_sender_only(
    store: Store,
) -> None:
    # The claim waits for the scope's dependency, so verification comes before any replay: a
    # forger who has a message's id and body gets 401, never the recorded answer.
    app = FastAPI()
    runs: list[str] = []

    @app.post("/webhooks/billing")
    @idempotent(key=from_header("webhook-id"), required=True, scope=Depends(standard_sender))
    async def billing(event: Annotated[Any, Depends(standard_event)]) -> dict[str, int]:
        runs.append(event["type"])
        return {"run": len(runs)}

    app.add_middleware(IdempotencyMiddleware, store=store)
    at = attempts(3)
    forged = standard_delivery("msg_1", STANDARD_PAYLOAD, at[1], secret="whsec_b3RoZXI=")
    async with client_for(app) as client:
        genuine, forger, again = [
            await client.post("/webhooks/billing", content=STANDARD_PAYLOAD, headers=headers)
            for headers in (
                standard_delivery("msg_1", STANDARD_PAYLOAD, at[0]),
                forged,
                standard_delivery("msg_1", STANDARD_PAYLOAD, at[2]),
            )
        ]
    assert (genuine.status_code, forger.status_code, again.status_code) == (200, 401, 200)
    assert again.headers["idempotent-replayed"] == "true"
    assert runs == ["invoice.paid"]


async def test_a_starlette_route_of_routes_reads_its_key_from_the_body(store: Store) -> None:
    runs: list[bytes] = []

    async def hooks(request: Request) -> JSONResponse:
        runs.append(await request.body())
        return JSONResponse({"run": len(runs)}, status_code=202)

    routes: dict[str, RouteOptions] = {
        "/hooks/*": {"key": from_json("data.object.id"), "required": True}
    }
    app = Starlette(
        routes=[Route("/hooks/{sender}", hooks, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=store, routes=routes)],
    )
    first = b'{"data": {"object": {"id": "obj_1"}}}'
    # The same event again, its JSON written otherwise: another request under the same key.
    reworded = b'{"data":{"object":{"id":"obj_1"}}}'
    async with client_for(app) as client:
        answers = [
            await client.post("/hooks/a", content=content)
            for content in (first, first, reworded, b'{"data": {}}')
        ]
    assert [a.status_code for a in answers] == [202, 202, 409, 400]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert answers[2].json()["type"].endswith(":mismatch")
    assert runs == [first]


async def test_a_body_too_large_for_its_key_to_be_read_is_a_413(store: Store) -> None:
    app = webhook_app(store, max_request_bytes=64)
    body = json.dumps({"id": "evt_1", "padding": "x" * 64}).encode()
    async with client_for(app) as client:
        answer = await client.post("/webhooks/stripe", content=body)
    assert answer.status_code == 413
    assert answer.json()["type"].endswith(":request-too-large")
    assert app.state.effects == []
