"""A service for ``uvicorn --workers N`` whose /metrics is prometheus_client's multiprocess view.

Run with ``PROMETHEUS_MULTIPROC_DIR`` set: each worker writes its counts there, and one scrape
of any worker adds up every worker's (tests/docs/test_first_hour.py).
"""

from __future__ import annotations

import os
import time

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from idempotency_mw import install
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.metrics import PrometheusMetrics


def create_app() -> FastAPI:
    app = FastAPI()
    install(app, store=MemoryStore(), on_event=PrometheusMetrics())

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/work")
    async def work() -> dict[str, int]:
        # Holds this worker's event loop a moment, so that concurrent requests reach the others.
        time.sleep(0.02)  # noqa: ASYNC251  (blocking on purpose)
        return {"pid": os.getpid()}

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
