"""The Lua scripts of RedisStore, read from the package's ``lua/`` folder."""

from __future__ import annotations

import hashlib
from importlib.resources import files

_LUA = files("idempotency_mw.stores.redis") / "lua"


class Script:
    """A Lua script and the SHA-1 by which Redis knows it once loaded."""

    def __init__(self, name: str, *, clock: bool = True) -> None:
        body = (_LUA / f"{name}.lua").read_text(encoding="utf-8")
        # The prelude defines now_ms() and int() for the scripts that read the server's clock.
        self.source = (_LUA / "prelude.lua").read_text(encoding="utf-8") + body if clock else body
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


CLAIM = Script("claim")
RENEW = Script("renew")
COMPLETE = Script("complete")
RELEASE = Script("release", clock=False)
ALL = (CLAIM, RENEW, COMPLETE, RELEASE)
