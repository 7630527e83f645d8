"""The one rule every entry applies to a key (an HTTP header's, a function's, an MCP call's),
and the keys derived from the key of the call being handled.

A handler that charges through a payment provider, or calls another service behind this
middleware, sends that call with a key of its own. Derived from the caller's scope and
credentials, the request's key and a name, the key is the same on every run of the same request
(a lease lost, a crash, a store that forgot), so the downstream API replays instead of acting
twice; and different for other names, other requests and other callers.
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Protocol, TypeGuard

from idempotency_mw.values.exceptions import ConfigurationError

MAX_KEY_LENGTH = 255
#: Separates these digests from any other sha256 of the same parts.
_DOMAIN = b"idempotency-mw downstream key\0"


def is_valid_key(key: object) -> TypeGuard[str]:
    """Whether ``key`` is a key: a string of 1-255 visible ASCII characters ("!" to "~"),
    which every store keeps as it is and a header can carry bare."""
    return (
        isinstance(key, str)
        and 1 <= len(key) <= MAX_KEY_LENGTH
        and key.isascii()
        and key.isprintable()
        and " " not in key
    )


def key_rule(name: str) -> str:
    """What a key named ``name`` must be, for an error that refuses one."""
    return f"{name} must be 1-{MAX_KEY_LENGTH} visible ASCII characters"


class HeldKey(Protocol):
    """What the derived keys are made of: the claim the engine holds for the call."""

    @property
    def scope(self) -> str: ...
    @property
    def binding(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def operations(self) -> dict[str, int]:
        """How many client operations of each name this run decided."""
        ...


#: The claim of the call being handled, set by the engine's entries around the handler (a
#: string: the call runs without one); copied into its tasks and worker threads.
current_claim: contextvars.ContextVar[HeldKey | str | None] = contextvars.ContextVar(
    "idempotency_mw_current_claim", default=None
)


def downstream_key(name: str) -> str:
    """The key of the downstream call ``name`` of the request, function call or MCP tool call
    being handled: 64 hex digits, the same on every run of that call.

    Raises :class:`~idempotency_mw.ConfigurationError` outside a protected call (no key is
    being handled: no middleware, a request without a key, or one the middleware runs
    unprotected because its store failed).
    """
    claim = current_claim.get()
    if claim is None or isinstance(claim, str):
        raise ConfigurationError(
            "downstream_key() is for code run under a key: a handler of a request the "
            "idempotency middleware protects (sent with a key), an idempotent function or a "
            "protected MCP tool"
        )
    if not isinstance(name, str) or not name:
        raise ConfigurationError("downstream_key() needs a non-empty name for the call")
    digest = hashlib.sha256(_DOMAIN)
    for part in (claim.scope, claim.binding, claim.key, name):
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return digest.hexdigest()


def operation_key(name: str, ref: str | None) -> str | None:
    """The key of the client's operation ``name`` decided in a protected call, or ``None``
    outside one: ``<name>:`` and :func:`downstream_key` of ``name@ref``, or without a ref, of
    ``name#n`` for the n-th operation of that name in this run (so a run that decides its
    operations in the same order gets the same keys)."""
    claim = current_claim.get()
    if claim is None or isinstance(claim, str):
        return None
    if ref is None:
        claim.operations[name] = seen = claim.operations.get(name, 0) + 1
        return f"{name}:{downstream_key(f'{name}#{seen}')}"
    return f"{name}:{downstream_key(f'{name}@{ref}')}"
