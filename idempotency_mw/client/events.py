"""What the client reports: one small frozen event per journaled change of an operation's state.

Pass a hook as a client's ``on_event=``: your own callable, or :class:`ClientMetrics` (extra
``[prometheus]``). Alert on ``needs_confirmation`` and ``needs_intervention``; a ``resolved``
event says such an operation (or one left ``unknown``) is settled at last. Events carry a short
digest of the key, never the key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from idempotency_mw.client.values import OperationState

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

#: States whose operation's outcome is in doubt: leaving them for a settled one resolves it.
IN_DOUBT = frozenset(
    {
        OperationState.UNKNOWN,
        OperationState.NEEDS_CONFIRMATION,
        OperationState.NEEDS_INTERVENTION,
    }
)


@dataclass(frozen=True, slots=True)
class ClientEvent:
    """The operation ``name`` was journaled ``state`` after ``previous``; or, with
    ``kept_until`` set, a warning: the server keeps its key only until then (Unix seconds),
    sooner than its retries may go on (``state`` is then ``previous``)."""

    state: OperationState
    previous: OperationState
    name: str
    #: 12 hex characters of sha256(key): never the key.
    key_digest: str
    kept_until: float | None = None

    @property
    def outlasts_retention(self) -> bool:
        """Whether this is the warning that retries outlast the server's retention."""
        return self.kept_until is not None

    @property
    def needs_attention(self) -> bool:
        """Whether a person has to look now (``needs_confirmation``, ``needs_intervention``)."""
        return self.state.needs_attention

    @property
    def resolved(self) -> bool:
        """Whether an operation whose outcome was in doubt is settled now."""
        return self.previous in IN_DOUBT and self.state.settled


ClientEventHook = Callable[[ClientEvent], None]


class ClientMetrics:
    """A client event hook that keeps Prometheus counters (needs the ``[prometheus]`` extra).

    - ``<namespace>_client_transitions_total{state, previous, operation}``: journaled changes;
    - ``<namespace>_client_resolved_total{state, operation}``: operations in doubt settled;
    - ``<namespace>_client_retention_warnings_total{operation}``: operations whose retries may
      outlast the server's retention of their key.

    Registered in ``registry`` (default: prometheus_client's global one): one instance per
    registry, shared by the clients of a process.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "idempotency"
    ) -> None:
        from prometheus_client import REGISTRY, Counter

        target = REGISTRY if registry is None else registry
        self.transitions = Counter(
            "client_transitions",
            "Journaled changes of an operation's state.",
            ["state", "previous", "operation"],
            namespace=namespace,
            registry=target,
        )
        self.resolved = Counter(
            "client_resolved",
            "Operations whose outcome was in doubt, settled.",
            ["state", "operation"],
            namespace=namespace,
            registry=target,
        )

        self.retention_warnings = Counter(
            "client_retention_warnings",
            "Operations whose retries may outlast the server's retention of their key.",
            ["operation"],
            namespace=namespace,
            registry=target,
        )

    def __call__(self, event: ClientEvent) -> None:
        if event.outlasts_retention:
            self.retention_warnings.labels(event.name).inc()
            return
        self.transitions.labels(event.state.value, event.previous.value, event.name).inc()
        if event.resolved:
            self.resolved.labels(event.state.value, event.name).inc()
