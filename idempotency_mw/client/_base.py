"""What the async and the sync client hold alike: their httpx client, journal and protocol."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import httpx

from idempotency_mw.client.journals import Journal, open_journal
from idempotency_mw.client.protocol import Protocol, ProtocolOptions
from idempotency_mw.values.exceptions import ConfigurationError

H = TypeVar("H", httpx.Client, httpx.AsyncClient)


class ClientBase(Generic[H]):
    """The state of a client: ``http`` (made by it when ``owns_http``), the journal (opened by
    it unless given as a :class:`Journal`), and the :class:`Protocol` built from ``options``."""

    def __init__(
        self,
        http: H,
        *,
        owns_http: bool,
        journal: Journal | str | os.PathLike[str],
        probed: Mapping[str, object],
        clock: Callable[[], float],
        options: ProtocolOptions,
    ) -> None:
        self._protocol = Protocol(
            http.build_request,
            clock=clock,
            probed=frozenset(probed),
            authenticates=lambda: http.auth is not None,
            **options,
        )
        self._http: H = http
        self._owns_http = owns_http
        self._owns_journal = not isinstance(journal, Journal)
        self._journal: Journal = journal if isinstance(journal, Journal) else open_journal(journal)

    @property
    def http(self) -> H:
        """The httpx client requests go through (for reads, and for probes)."""
        return self._http

    @property
    def journal(self) -> Journal:
        """The journal of this client's operations."""
        return self._journal

    @property
    def protocol(self) -> Protocol:
        """The sans-IO protocol this client performs (see :meth:`IdempotentClient.perform`)."""
        return self._protocol


def check_http_options(
    given: object, headers: Mapping[str, str] | None, auth: httpx.Auth | None
) -> None:
    """Raise if ``headers=`` or ``auth=`` come with an httpx client they cannot reach."""
    if given is not None and (headers is not None or auth is not None):
        raise ConfigurationError(
            "headers= and auth= configure the httpx client the client makes:"
            " set them on the httpx client you give instead"
        )
