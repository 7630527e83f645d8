"""The example service's own endpoints beyond the tickets: /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from example_app.app import create_app
from idempotency_mw.values.metrics import Event, EventKind


@pytest.mark.anyio
async def test_metrics_endpoint_serves_the_prometheus_metrics(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'example.db'}")
    app.state.metrics(Event(EventKind.REPLAY, "0123456789ab", "POST", "/tickets"))
    async with (
        LifespanManager(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client,
    ):
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert "idempotency_in_flight_claims 0.0" in lines
    assert 'idempotency_requests_total{kind="replay",method="POST",route="/tickets"} 1.0' in lines
