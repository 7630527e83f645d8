"""What the middleware reports: one small frozen event per outcome and per store call.

Pass a hook as the middleware's ``on_event=``: your own callable, :class:`PrometheusMetrics`
(extra ``[prometheus]``), :class:`OpenTelemetryHook` (extra ``[otel]``), or several of them
through :func:`combine`. Events carry a short hash of caller scope and key, never the key.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.metrics import Meter
    from opentelemetry.trace import Tracer
    from prometheus_client import CollectorRegistry

logger = logging.getLogger("idempotency_mw")


class EventKind(enum.StrEnum):
    """What happened."""

    FIRST_RUN = "first_run"
    REPLAY = "replay"
    MISMATCH = "mismatch"
    IN_PROGRESS = "in_progress"
    NOT_REPLAYABLE = "not_replayable"
    RELEASED = "released"
    STORE_ERROR = "store_error"
    LEASE_LOST = "lease_lost"
    CREDENTIAL_MISMATCH = "credential_mismatch"
    RECORD_TOO_LARGE = "record_too_large"
    COMMITTED_WITHOUT_RESPONSE = "committed_without_response"
    #: Refused: first sent longer ago than the key is kept, and no record found.
    EXPIRED_KEY = "expired_key"
    #: One store operation finished (ok or not).
    STORE_CALL = "store_call"
    #: A claim was acquired / settled: the in-flight gauge goes up / down.
    CLAIM_STARTED = "claim_started"
    CLAIM_ENDED = "claim_ended"


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened to one keyed request."""

    kind: EventKind
    #: 12 hex characters of a sha256 of scope and key (see :func:`key_hash`): never the key.
    key_hash: str
    method: str
    #: The route template, e.g. ``/tickets/{ticket_id}``.
    route: str
    #: STORE_CALL only: ``"claim"``, ``"renew"``, ``"complete"``, ``"release"`` or ``"purge"``.
    operation: str | None = None
    #: STORE_CALL: ``time.time()`` when the call started (for spans).
    started_at: float | None = None
    #: STORE_CALL: how long the call took, in seconds.
    duration: float | None = None
    #: STORE_CALL and STORE_ERROR: the error's one-line description.
    error: str | None = None


EventHook = Callable[[Event], None]


def key_digest(scope: str, key: str) -> str:
    """A sha256 (64 hex digits) of a caller scope and key, whose start is :func:`key_hash`.

    The scope is length-prefixed: a separator could also be inside a scope or a key, and two
    pairs would share a hash (and wake each other's waiting duplicates).
    """
    scope_bytes = scope.encode("utf-8", "surrogatepass")
    pair = b"%d:%s%s" % (len(scope_bytes), scope_bytes, key.encode("utf-8", "surrogatepass"))
    return hashlib.sha256(pair).hexdigest()


def key_hash(scope: str, key: str) -> str:
    """The short hash of a caller scope and key that events and log lines carry."""
    return key_hash_of(key_digest(scope, key))


def key_hash_of(digest: str) -> str:
    """The :func:`key_hash` of the pair whose :func:`key_digest` is ``digest``."""
    return digest[:12]


def guard(hook: EventHook) -> EventHook:
    """``hook``, made unable to raise: its first failure is logged, later ones are dropped.

    A metrics backend that breaks must never fail the request it observes.
    """
    failed = False

    def guarded(event: Event) -> None:
        nonlocal failed
        try:
            hook(event)
        except Exception:
            if not failed:
                failed = True
                logger.exception(
                    "idempotency event hook %r failed; its later failures are not logged", hook
                )

    return guarded


def combine(*hooks: EventHook) -> EventHook:
    """One hook that passes each event to every one of ``hooks``, each guarded on its own."""
    guarded = tuple(guard(hook) for hook in hooks)

    def combined(event: Event) -> None:
        for hook in guarded:
            hook(event)

    return combined


def _store_result(event: Event) -> str:
    return "ok" if event.error is None else "error"


class PrometheusMetrics:
    """An event hook that keeps Prometheus metrics (needs the ``[prometheus]`` extra).

    - ``<namespace>_requests_total{kind, method, route}``: keyed requests by outcome;
    - ``<namespace>_store_call_seconds{operation, result}``: store call latency (a histogram);
    - ``<namespace>_in_flight_claims``: claims acquired and not yet settled.

    The metrics are registered in ``registry`` (default: prometheus_client's global one), so
    make one instance per registry and serve it with ``prometheus_client.generate_latest``.
    Under several worker processes, prometheus_client's multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR``) adds up every worker's counts, the gauge's live ones.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "idempotency"
    ) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        target = REGISTRY if registry is None else registry
        self.requests = Counter(
            "requests",
            "Keyed requests by outcome.",
            ["kind", "method", "route"],
            namespace=namespace,
            registry=target,
        )
        self.store_call_seconds = Histogram(
            "store_call_seconds",
            "Latency of store operations, in seconds.",
            ["operation", "result"],
            namespace=namespace,
            registry=target,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.in_flight_claims = Gauge(
            "in_flight_claims",
            "Claims acquired and not yet settled.",
            namespace=namespace,
            registry=target,
            # In prometheus_client's multiprocess mode, one scrape sums the live workers' claims.
            multiprocess_mode="livesum",
        )

    def __call__(self, event: Event) -> None:
        match event.kind:
            case EventKind.STORE_CALL:
                self.store_call_seconds.labels(event.operation, _store_result(event)).observe(
                    event.duration or 0.0
                )
            case EventKind.CLAIM_STARTED:
                self.in_flight_claims.inc()
            case EventKind.CLAIM_ENDED:
                self.in_flight_claims.dec()
            case _:
                self.requests.labels(event.kind.value, event.method, event.route).inc()


class OpenTelemetryHook:
    """An event hook that records OpenTelemetry spans and metrics (needs the ``[otel]`` extra).

    Each store call becomes a span (``idempotency <operation>``, with the call's own start and
    end times, and the attribute ``idempotency.key_hash``, never the key), a child of the
    span current when the event is emitted. Metrics: the counter ``idempotency.requests``
    (outcomes), the histogram ``idempotency.store.duration`` (seconds) and the up-down counter
    ``idempotency.claims.in_flight``. ``tracer`` and ``meter`` default to the global providers'.
    """

    def __init__(self, tracer: Tracer | None = None, meter: Meter | None = None) -> None:
        from opentelemetry import metrics, trace

        self._tracer = tracer or trace.get_tracer("idempotency_mw")
        meter = meter or metrics.get_meter("idempotency_mw")
        self._requests = meter.create_counter(
            "idempotency.requests", unit="{request}", description="Keyed requests by outcome."
        )
        self._store_duration = meter.create_histogram(
            "idempotency.store.duration", unit="s", description="Latency of store operations."
        )
        self._in_flight = meter.create_up_down_counter(
            "idempotency.claims.in_flight",
            unit="{claim}",
            description="Claims acquired and not yet settled.",
        )

    def __call__(self, event: Event) -> None:
        match event.kind:
            case EventKind.STORE_CALL:
                self._store_call(event)
            case EventKind.CLAIM_STARTED:
                self._in_flight.add(1)
            case EventKind.CLAIM_ENDED:
                self._in_flight.add(-1)
            case _:
                self._requests.add(
                    1,
                    {
                        "idempotency.outcome": event.kind.value,
                        "http.request.method": event.method,
                        "http.route": event.route,
                    },
                )

    def _store_call(self, event: Event) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        duration = event.duration or 0.0
        operation = event.operation or "unknown"
        attributes: dict[str, Any] = {
            "idempotency.key_hash": event.key_hash,
            "idempotency.operation": operation,
            "http.request.method": event.method,
            "http.route": event.route,
        }
        start_ns = None if event.started_at is None else int(event.started_at * 1e9)
        span = self._tracer.start_span(
            f"idempotency {operation}",
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=start_ns,
        )
        if event.error is not None:
            span.set_status(Status(StatusCode.ERROR, event.error))
        span.end(end_time=None if start_ns is None else start_ns + int(duration * 1e9))
        self._store_duration.record(
            duration,
            {"idempotency.operation": operation, "idempotency.result": _store_result(event)},
        )
