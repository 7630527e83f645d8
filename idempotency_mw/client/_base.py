"""What the async and the sync client hold alike: their httpx client, probes, core and sleep."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import httpx

from idempotency_mw.client.core import Core, CoreOptions
from idempotency_mw.client.journals import Journal
from idempotency_mw.exceptions import ConfigurationError

H = TypeVar("H", httpx.Client, httpx.AsyncClient)
P = TypeVar("P")
S = TypeVar("S")


class ClientBase(Generic[H, P, S]):
    """The state of a client: ``http`` (made by it when ``owns_http``), the probes of
    ``confirm``, the :class:`Core` and the ``sleep`` it waits with."""

    def __init__(
        self,
        http: H,
        *,
        owns_http: bool,
        journal: Journal | str | os.PathLike[str],
        confirm: Mapping[str, P] | None,
        sleep: S,
        clock: Callable[[], float],
        options: CoreOptions,
    ) -> None:
        self._http: H = http
        self._probes: dict[str, P] = dict(confirm or {})
        self._core = Core(
            http,
            owns_http=owns_http,
            journal=journal,
            clock=clock,
            probed=frozenset(self._probes),
            **options,
        )
        self._sleep: S = sleep

    @property
    def http(self) -> H:
        """The httpx client requests go through (for reads, and for probes)."""
        return self._http

    @property
    def journal(self) -> Journal:
        """The journal of this client's operations."""
        return self._core.journal


def check_http_options(
    given: object, headers: Mapping[str, str] | None, auth: httpx.Auth | None
) -> None:
    """Raise if ``headers=`` or ``auth=`` come with an httpx client they cannot reach."""
    if given is not None and (headers is not None or auth is not None):
        raise ConfigurationError(
            "headers= and auth= configure the httpx client the client makes:"
            " set them on the httpx client you give instead"
        )
