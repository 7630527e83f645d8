"""The middleware's options: validated and precomputed once, then frozen."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from idempotency_mw.engine.cleanup import PurgeSchedule
from idempotency_mw.http._asgi import REPLAYED
from idempotency_mw.stores.base import KeyLookup, Store, takes_keyword
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.metrics import EventHook, guard
from idempotency_mw.values.settings import LeaseLostAction, RouteOptions, Settings, settings_of
from idempotency_mw.wire.credentials import CREDENTIAL_HEADERS
from idempotency_mw.wire.http import PER_ATTEMPT_HEADERS

DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Methods without effects (RFC 9110): repeatable by nature, never refused for a request id.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: Headers left out of a record: credentials a handler may echo, challenges, hop-by-hop headers.
DEFAULT_UNRECORDED_HEADERS = CREDENTIAL_HEADERS | frozenset(
    {
        "www-authenticate",
        "proxy-authenticate",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Never recorded whatever the lists say: a replay sets this header itself, once.
_ALWAYS_UNRECORDED = frozenset({REPLAYED[0]})

CallerScope = Callable[[HTTPConnection], str | Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Options:
    """The middleware's settings, validated and precomputed once."""

    store: Store
    defaults: Settings
    methods: frozenset[str]
    header_name: str
    #: The OASIS key header (``None``: not read).
    request_id_header: str | None
    #: The first-sent time's header.
    first_sent_header: str
    #: Where ``GET <lookup_path>/<key>`` is answered (``None``: nowhere).
    lookup_path: str | None
    #: The request headers the middleware reads (key, Content-Length, Content-Type,
    #: credentials, fingerprint).
    read_headers: frozenset[bytes]
    routes: Mapping[str, RouteOptions]
    caller_scope: CallerScope | None
    #: The headers a record is bound to (``None``: those the rule of :mod:`credentials` names).
    credential_headers: tuple[str, ...] | None
    credential_cookies: tuple[str, ...]
    fingerprint_headers: tuple[str, ...]
    max_response_bytes: int
    max_header_bytes: int
    store_server_errors: bool
    mismatch_status: int
    fail_open: bool
    retry_after: int
    records_header: Callable[[bytes], bool]
    on_lease_lost: LeaseLostAction
    purge: PurgeSchedule | None
    lifespan: bool
    server_checks: bool
    on_event: EventHook | None


def build_options(
    *,
    store: Store,
    methods: Iterable[str],
    header_name: str,
    request_id_header: str | None,
    first_sent_header: str,
    lookup_path: str | None,
    routes: Mapping[str, RouteOptions] | None,
    scope: CallerScope | None,
    credential_headers: Iterable[str] | None,
    credential_cookies: Iterable[str],
    fingerprint_headers: Iterable[str],
    max_response_bytes: int,
    max_header_bytes: int,
    store_server_errors: bool,
    mismatch_status: int,
    fail_open: bool,
    retry_after: int,
    replay_headers_allow: Iterable[str] | None,
    replay_headers_deny: Iterable[str],
    on_lease_lost: LeaseLostAction,
    purge: PurgeSchedule | None,
    lifespan: bool,
    server_checks: bool,
    on_event: EventHook | None,
    settings: Mapping[str, object],
) -> Options:
    """The options of :class:`~idempotency_mw.IdempotencyMiddleware`, validated: its
    constructor's keyword arguments (documented and given their defaults there), the route
    settings (:class:`~idempotency_mw.RouteOptions`) among them as ``settings``."""
    if not isinstance(store, Store):
        raise ConfigurationError(f"store must implement the Store protocol, got {store!r}")
    if not takes_keyword(store.claim, "binding"):
        raise ConfigurationError(
            f"{store!r}.claim() must accept binding= (the Store protocol binds records to "
            "the caller's credentials)"
        )
    if mismatch_status not in (409, 422):
        raise ConfigurationError("mismatch_status must be 409 or 422")
    if min(max_response_bytes, max_header_bytes, retry_after) < 0:
        raise ConfigurationError("size limits and retry_after must not be negative")
    if on_lease_lost not in ("cancel", "continue"):
        raise ConfigurationError("on_lease_lost must be 'cancel' or 'continue'")
    if lookup_path is not None:
        if not lookup_path.startswith("/") or lookup_path.endswith("/"):
            raise ConfigurationError(
                f"lookup_path must start with '/' and not end with one, got {lookup_path!r}"
            )
        if not isinstance(store, KeyLookup):
            raise ConfigurationError(f"lookup_path needs a store that can look keys up: {store!r}")
    deny = {h.lower().encode("latin-1") for h in replay_headers_deny} | _ALWAYS_UNRECORDED
    allow = (
        None
        if replay_headers_allow is None
        else frozenset(h.lower().encode("latin-1") for h in replay_headers_allow) - deny
    )
    credentials = (
        None
        if credential_headers is None
        else tuple(sorted({name.lower() for name in credential_headers}))
    )
    fingerprinted = tuple(sorted({name.lower() for name in fingerprint_headers}))
    per_attempt = sorted(PER_ATTEMPT_HEADERS.intersection((*(credentials or ()), *fingerprinted)))
    if per_attempt:
        raise ConfigurationError(
            f"{per_attempt} change with every delivery attempt: as credentials or in the "
            "fingerprint, every re-delivery of a message would be refused with 409"
        )
    return Options(
        store=store,
        defaults=settings_of(settings),
        methods=frozenset(method.upper() for method in methods),
        header_name=header_name,
        request_id_header=request_id_header,
        first_sent_header=first_sent_header,
        lookup_path=lookup_path,
        read_headers=frozenset(
            name.lower().encode("latin-1")
            for name in (
                header_name,
                *(() if request_id_header is None else (request_id_header,)),
                first_sent_header,
                "content-length",
                "content-type",
                *(credentials or ()),
                *fingerprinted,
            )
        ),
        routes=dict(routes or {}),
        caller_scope=scope,
        credential_headers=credentials,
        credential_cookies=tuple(sorted(set(credential_cookies))),
        fingerprint_headers=fingerprinted,
        max_response_bytes=max_response_bytes,
        max_header_bytes=max_header_bytes,
        store_server_errors=store_server_errors,
        mismatch_status=mismatch_status,
        fail_open=fail_open,
        retry_after=retry_after,
        records_header=(lambda name: name not in deny) if allow is None else allow.__contains__,
        on_lease_lost=on_lease_lost,
        purge=purge,
        lifespan=lifespan,
        server_checks=server_checks,
        on_event=None if on_event is None else guard(on_event),
    )
