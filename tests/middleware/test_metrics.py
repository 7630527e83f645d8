"""The event hooks: Prometheus and OpenTelemetry values as their exporters see them."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from idempotency_mw.values.metrics import (
    Event,
    EventKind,
    OpenTelemetryHook,
    PrometheusMetrics,
    combine,
    guard,
    key_hash,
)

KEY = "order-17-secret-key"
HASH = key_hash("alice", KEY)
ROUTE = "/tickets/{ticket_id}"


def outcome(kind: EventKind, method: str = "POST") -> Event:
    return Event(kind, HASH, method, ROUTE)


def store_call(
    operation: str, started_at: float, duration: float, error: str | None = None
) -> Event:
    return Event(
        EventKind.STORE_CALL,
        HASH,
        "POST",
        ROUTE,
        operation=operation,
        started_at=started_at,
        duration=duration,
        error=error,
    )


def test_key_hash_is_the_log_lines_hash_of_scope_and_key() -> None:
    assert hashlib.sha256(f"5:alice{KEY}".encode()).hexdigest()[:12] == HASH  # length-prefixed
    assert key_hash("bob", KEY) != HASH


# --- Prometheus ---------------------------------------------------------------------------------


def test_prometheus_counts_outcomes_by_kind_method_and_route() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    for event in [
        outcome(EventKind.FIRST_RUN),
        outcome(EventKind.REPLAY),
        outcome(EventKind.REPLAY),
        outcome(EventKind.MISMATCH, method="PUT"),
    ]:
        metrics(event)

    def count(kind: str, method: str = "POST") -> float | None:
        labels = {"kind": kind, "method": method, "route": ROUTE}
        return registry.get_sample_value("idempotency_requests_total", labels)

    assert count("first_run") == 1
    assert count("replay") == 2
    assert count("mismatch", "PUT") == 1
    assert count("mismatch") is None


def test_prometheus_store_latency_histogram_by_operation_and_result() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry, namespace="api")
    now = time.time()
    metrics(store_call("claim", now, 0.002))
    metrics(store_call("claim", now, 0.004))
    metrics(store_call("complete", now, 0.3, error="TimeoutError: the store did not answer"))

    def sample(suffix: str, operation: str, result: str, **extra: str) -> float | None:
        labels = {"operation": operation, "result": result, **extra}
        return registry.get_sample_value(f"api_store_call_seconds_{suffix}", labels)

    assert sample("count", "claim", "ok") == 2
    assert sample("sum", "claim", "ok") == pytest.approx(0.006)
    assert sample("bucket", "claim", "ok", le="0.0025") == 1
    assert sample("bucket", "claim", "ok", le="0.005") == 2
    assert sample("count", "complete", "error") == 1
    assert sample("count", "complete", "ok") is None
    # Store calls are latencies, not outcomes.
    assert (
        registry.get_sample_value(
            "api_requests_total", {"kind": "store_call", "method": "POST", "route": ROUTE}
        )
        is None
    )


def test_prometheus_gauge_follows_claims_in_flight() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)

    def in_flight() -> float | None:
        return registry.get_sample_value("idempotency_in_flight_claims")

    assert in_flight() == 0
    metrics(outcome(EventKind.CLAIM_STARTED))
    metrics(outcome(EventKind.CLAIM_STARTED))
    assert in_flight() == 2
    metrics(outcome(EventKind.CLAIM_ENDED))
    assert in_flight() == 1


# --- OpenTelemetry ------------------------------------------------------------------------------


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer_provider = tracer_provider
        self.hook = OpenTelemetryHook(
            tracer=tracer_provider.get_tracer("test"), meter=self.meter_provider.get_meter("test")
        )

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    made = Telemetry()
    yield made
    made.tracer_provider.shutdown()
    made.meter_provider.shutdown()


def test_otel_span_per_store_call_with_the_event_times_and_the_key_hash(
    telemetry: Telemetry,
) -> None:
    started = time.time() - 5  # an event handled late still spans the call's own time
    telemetry.hook(store_call("claim", started, 0.25))
    telemetry.hook(store_call("release", started + 1, 0.5, error="StoreError: connection reset"))

    claim, release = telemetry.spans.get_finished_spans()
    assert claim.name == "idempotency claim"
    assert claim.start_time == int(started * 1e9)
    assert claim.end_time == int(started * 1e9) + 250_000_000
    assert claim.attributes is not None
    assert claim.attributes["idempotency.key_hash"] == HASH
    assert claim.attributes["http.route"] == ROUTE
    assert claim.status.status_code is StatusCode.UNSET
    assert release.status.status_code is StatusCode.ERROR
    assert release.status.description == "StoreError: connection reset"
    for span in (claim, release):
        assert KEY not in repr(dict(span.attributes or {}))


def test_otel_metrics_count_outcomes_latency_and_claims_in_flight(telemetry: Telemetry) -> None:
    telemetry.hook(outcome(EventKind.FIRST_RUN))
    telemetry.hook(outcome(EventKind.REPLAY))
    telemetry.hook(outcome(EventKind.REPLAY))
    telemetry.hook(outcome(EventKind.CLAIM_STARTED))
    telemetry.hook(outcome(EventKind.CLAIM_STARTED))
    telemetry.hook(outcome(EventKind.CLAIM_ENDED))
    telemetry.hook(store_call("complete", time.time(), 0.125))

    requests = {
        point.attributes["idempotency.outcome"]: point.value
        for point in telemetry.points("idempotency.requests")
    }
    assert requests == {"first_run": 1, "replay": 2}
    (in_flight,) = telemetry.points("idempotency.claims.in_flight")
    assert in_flight.value == 1
    (duration,) = telemetry.points("idempotency.store.duration")
    assert (duration.count, duration.sum) == (1, 0.125)
    assert dict(duration.attributes) == {
        "idempotency.operation": "complete",
        "idempotency.result": "ok",
    }


# --- guard and combine --------------------------------------------------------------------------


def test_a_failing_hook_never_raises_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Event] = []

    def broken(event: Event) -> None:
        calls.append(event)
        raise RuntimeError("metrics backend down")

    hook = guard(broken)
    with caplog.at_level(logging.ERROR, logger="idempotency_mw"):
        hook(outcome(EventKind.FIRST_RUN))
        hook(outcome(EventKind.REPLAY))
    assert len(calls) == 2
    (record,) = caplog.records
    assert "failed" in record.getMessage()
    assert KEY not in caplog.text


def test_combine_passes_every_event_to_every_hook_even_after_one_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    seen: list[EventKind] = []

    def broken(event: Event) -> None:
        raise ValueError("boom")

    hook = combine(broken, PrometheusMetrics(registry), lambda event: seen.append(event.kind))
    with caplog.at_level(logging.ERROR, logger="idempotency_mw"):
        hook(outcome(EventKind.FIRST_RUN))
        hook(outcome(EventKind.STORE_ERROR))
    assert seen == [EventKind.FIRST_RUN, EventKind.STORE_ERROR]
    labels = {"kind": "store_error", "method": "POST", "route": ROUTE}
    assert registry.get_sample_value("idempotency_requests_total", labels) == 1
    assert len(caplog.records) == 1
