"""Store URLs as logs, errors, the CLI and the panel show them: never with a password."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

#: What a password is shown as (SQLAlchemy's own mask).
HIDDEN = "***"


def shown_url(url: str | URL) -> str:
    """``url`` with the password of its login and of its query string (``?password=``, and any
    parameter whose name ends in ``password``, e.g. ``sentinel_password``) replaced by
    ``***``; the rest as it was written."""
    text = url if isinstance(url, str) else url.render_as_string(hide_password=True)
    parts = urlsplit(text)
    # Each part replaced where it stands (putting the parts together again would drop the
    # empty host of sqlite:///).
    login, at, host = parts.netloc.rpartition("@")
    if at and ":" in login:
        text = text.replace(parts.netloc, f"{login.partition(':')[0]}:{HIDDEN}@{host}", 1)
    if parts.query:
        query = "&".join(_shown_parameter(field) for field in parts.query.split("&"))
        text = text.replace(f"?{parts.query}", f"?{query}", 1)
    return text


def _shown_parameter(field: str) -> str:
    name, equals, _ = field.partition("=")
    secret = unquote(name).lower().endswith(("password", "passwd", "pwd"))
    return f"{name}={HIDDEN}" if equals and secret else field
