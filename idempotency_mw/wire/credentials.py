"""What a credential is, and what of one stays the same across a caller's retries.

One rule for both halves: the client never journals a header :func:`is_credential` names, the
server never records one, the panel hides one, and a record is bound to the digest of what
:func:`identity` keeps of each.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence

#: Request headers that carry a caller's credentials, lower case: the standard ones and the
#: API-key headers SDKs send.
CREDENTIAL_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "set-cookie",
        "api-key",
        "apikey",
        "x-api-key",
        "x-goog-api-key",
        "ocp-apim-subscription-key",
        "x-functions-key",
        "x-amz-security-token",
    }
)
#: A vendor's own key or token header (``x-acme-api-key``, ``x-auth-token``) is one too.
_CREDENTIAL_SUFFIXES = ("-api-key", "-apikey", "-token", "-secret", "-password")
#: Schemes whose value is ``<key id>:<signature>`` (AWS signature version 2, Azure Storage).
_KEY_COLON_SIGNATURE = frozenset({"aws", "sharedkey", "sharedkeylite"})
_PARAMETER = re.compile(r'([A-Za-z][A-Za-z0-9_-]*)\s*=\s*("[^"]*"|[^\s,&]*)')


def is_credential(name: str) -> bool:
    """Whether the header ``name`` carries credentials (never journaled, recorded or shown)."""
    lowered = name.lower()
    return lowered in CREDENTIAL_HEADERS or lowered.endswith(_CREDENTIAL_SUFFIXES)


def is_bound(name: str) -> bool:
    """Whether a record is bound to the header ``name`` by default: every credential but
    cookies, which carry much else (name the ones that matter in ``credential_cookies``)."""
    return is_credential(name) and name.lower() not in ("cookie", "set-cookie")


def identity(value: str) -> str:
    """What of a credential stays the same across a caller's retries.

    A token (``Bearer``, ``Basic``, an API key) is itself. A signature scheme signs every
    attempt anew over its time, so only its scheme and key id count: ``Credential=`` up to its
    first ``/`` (AWS SigV4's ``AKID/<date>/...``, Azure App Configuration's id), ``keyId=``
    (HTTP Signatures), the part before ``:`` of ``SharedKey account:signature``. A scheme
    with a signature and no key id (Azure Communication's ``HMAC-SHA256``) is its scheme.
    """
    scheme, _, rest = value.strip().partition(" ")
    scheme = scheme.lower()
    parameters = {name.lower(): given.strip('"') for name, given in _PARAMETER.findall(rest)}
    if "signature" in parameters:
        kept = [scheme]
        if "credential" in parameters:
            kept.append("credential=" + parameters["credential"].split("/", 1)[0])
        if "keyid" in parameters:
            kept.append("keyid=" + parameters["keyid"])
        return " ".join(kept)
    if scheme in _KEY_COLON_SIGNATURE and ":" in rest:
        return f"{scheme} {rest.strip().rpartition(':')[0]}"
    return value


def credential_digest(values: Sequence[tuple[str, str]]) -> str:
    """Hex SHA-256 over length-prefixed credential names and their :func:`identity` (never
    stored in clear)."""
    digest = hashlib.sha256()
    for name, value in values:
        for field in (name, identity(value)):
            encoded = field.encode("utf-8", "surrogateescape")
            digest.update(len(encoded).to_bytes(8, "big"))
            digest.update(encoded)
    return digest.hexdigest()


def bound_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers among ``headers`` a record is bound to by default (see :func:`is_bound`),
    names lower case, sorted by name (values in their order)."""
    return sorted(
        ((name.lower(), value) for name, value in headers if is_bound(name)),
        key=lambda pair: pair[0],
    )
