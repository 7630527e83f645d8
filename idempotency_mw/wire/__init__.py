"""What both halves say on the wire: the key rule and the keys derived from a key
(:mod:`~idempotency_mw.wire.keys`), header names and HTTP dates
(:mod:`~idempotency_mw.wire.http`), credentials (:mod:`~idempotency_mw.wire.credentials`), the
lookup's answer (:mod:`~idempotency_mw.wire.lookup`) and MCP's ``_meta`` names and lookup
method (:mod:`~idempotency_mw.wire.mcp`, with the ``[mcp]`` extra).

The caller's half imports these, never a module of the server; they import nothing of the
package but its values.
"""
