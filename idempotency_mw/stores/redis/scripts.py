"""The Lua scripts of RedisStore, read from the package's ``lua/`` folder."""

from __future__ import annotations

from importlib.resources import files

_LUA = files("idempotency_mw.stores.redis") / "lua"


def _source(name: str, *, clock: bool = True) -> str:
    body = (_LUA / f"{name}.lua").read_text(encoding="utf-8")
    # The prelude defines now_ms() and int() for the scripts that read the server's clock.
    return (_LUA / "prelude.lua").read_text(encoding="utf-8") + body if clock else body


CLAIM = _source("claim")
RENEW = _source("renew")
COMPLETE = _source("complete")
RELEASE = _source("release", clock=False)
#: A caller's look at its own key's record (KeyLookup).
LOOKUP = _source("lookup")
#: The operator's: a record's fields (and the server's clock), and a forced release.
INSPECT = _source("inspect")
FORGET = _source("forget", clock=False)
ALL = (CLAIM, RENEW, COMPLETE, RELEASE, LOOKUP, INSPECT, FORGET)
