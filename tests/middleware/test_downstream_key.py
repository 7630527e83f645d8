"""downstream_key() in a protected handler: the same on every run of one request, different
for other names, keys and callers; refused where no key is handled."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from idempotency_mw import ConfigurationError, IdempotencyMiddleware, downstream_key
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for

pytestmark = pytest.mark.anyio


def app_of(store: MemoryStore) -> FastAPI:
    """``POST /charge`` notes the downstream keys of each of its runs in ``app.state.keys``."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.state.keys = []

    @app.post("/charge")
    async def charge(fail: bool = False) -> str:
        app.state.keys.append((downstream_key("provider"), downstream_key("ledger")))
        if fail:  # a 5xx releases the key: the retry runs the handler again
            raise RuntimeError("the handler crashed after calling the provider")
        return "charged"

    @app.post("/anywhere")
    async def anywhere() -> str:
        try:
            return downstream_key("provider")
        except ConfigurationError as exc:
            return str(exc)

    return app


async def test_every_run_of_one_request_derives_the_same_keys(store: MemoryStore) -> None:
    app = app_of(store)
    alice = {"Authorization": "Bearer alice", "Idempotency-Key": "k"}
    async with client_for(app) as client:
        assert (await client.post("/charge?fail=true", headers=alice)).status_code == 500
        assert (await client.post("/charge?fail=true", headers=alice)).status_code == 500
        assert (await client.post("/charge", headers=alice)).status_code == 200
        assert (await client.post("/charge", headers={**alice, "Idempotency-Key": "k2"})).is_success
        unkeyed = (await client.post("/anywhere")).text
    crashed, crashed_again, completed, other_key = app.state.keys
    assert crashed == crashed_again == completed
    provider, ledger = completed
    assert provider != ledger
    assert len(provider) == 64
    assert all(c in "0123456789abcdef" for c in provider)
    assert other_key[0] != provider
    assert "under a key" in unkeyed
    # Another caller sending the same key (to a store of its own) derives other keys.
    bob = app_of(MemoryStore())
    async with client_for(bob) as client:
        await client.post("/charge", headers={**alice, "Authorization": "Bearer bob"})
    assert bob.state.keys[0][0] != provider
