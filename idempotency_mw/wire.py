"""The one rule every entry applies to a key (an HTTP header's, a function's, an MCP call's),
and where an HTTP route finds its key: :func:`from_header`, :func:`from_json`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TypeGuard

from idempotency_mw.values.exceptions import ConfigurationError

MAX_KEY_LENGTH = 255
#: An HTTP header's name: an RFC 9110 token.
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: Headers a webhook's sender makes anew for every attempt of one message (a timestamp, a
#: signature over it): as a key, a credential or a part of the fingerprint, they would make
#: every re-delivery a new request or a 409.
PER_ATTEMPT_HEADERS = frozenset(
    {
        "webhook-timestamp",
        "webhook-signature",
        "svix-timestamp",
        "svix-signature",
        "stripe-signature",
        "x-hub-signature",
        "x-hub-signature-256",
    }
)


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


class NotAKey(ValueError):
    """A JSON body that holds no usable key where its route reads it; the message says why."""


@dataclass(frozen=True, slots=True)
class KeySource:
    """Where an HTTP route's requests carry their key, instead of the middleware's
    ``header_name``: made by :func:`from_header` or :func:`from_json`. A route with its own
    source keeps its keys apart from every other route's."""

    #: The header's name as given, or the dotted path of a field of the JSON body.
    name: str
    in_body: bool

    @property
    def label(self) -> str:
        """How an answer names it: the header, or the field with where it is."""
        return f"{self.name} in the JSON body" if self.in_body else self.name

    def in_json(self, body: bytes) -> str | None:
        """The key's raw value in ``body`` (an integer as its digits), ``None`` when the field
        or the body is absent or the field is null. Raises :class:`NotAKey` for a body that is
        not JSON or a field that is neither a string nor an integer."""
        if not body.strip():
            return None
        try:
            value: object = json.loads(body)
        except (ValueError, RecursionError):
            raise NotAKey(f"The body is not JSON; this operation's key is {self.label}") from None
        for name in self.name.split("."):
            if not isinstance(value, dict):
                return None
            value = value.get(name)
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise NotAKey(f"{self.label} must be a string or an integer")


def from_header(name: str) -> KeySource:
    """The route's key is the value of the request header ``name`` (e.g. ``"webhook-id"``,
    ``"X-GitHub-Delivery"``), read by the same rule as ``Idempotency-Key``."""
    if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
        raise ConfigurationError(f"from_header() takes a header's name, got {name!r}")
    if name.lower() in PER_ATTEMPT_HEADERS:
        raise ConfigurationError(
            f"{name} changes with every delivery attempt, so it cannot be a key: "
            "use the message's id (e.g. webhook-id)"
        )
    return KeySource(name, in_body=False)


def from_json(path: str) -> KeySource:
    """The route's key is a field of the JSON request body, named by a dotted path (``"id"``,
    ``"data.object.id"``): a string, or an integer."""
    if not isinstance(path, str) or not all(path.split(".")):
        raise ConfigurationError(
            f"from_json() takes a dotted path of field names, e.g. 'data.object.id', got {path!r}"
        )
    return KeySource(path, in_body=True)
