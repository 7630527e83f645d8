"""Where an HTTP route finds its key, when not in the middleware's ``header_name``:
:func:`from_header`, :func:`from_json`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.wire.http import HEADER_NAME, PER_ATTEMPT_HEADERS


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
