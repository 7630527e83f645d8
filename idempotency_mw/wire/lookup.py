"""What the lookup of a key answers, over HTTP (``GET <lookup_path>/<key>``) and MCP alike."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from idempotency_mw.values.records import KeyState, RecordState


def state_json(state: RecordState | None) -> dict[str, Any]:
    """What a lookup answers (JSON): ``state``, and by state ``expires_at``, ``lease_until``,
    ``status`` and ``replayable`` (times in RFC 3339, UTC). Nothing else: a key another caller
    holds must read as one never seen."""
    if state is None:
        return {"state": KeyState.UNKNOWN.value}
    found: dict[str, Any] = {"state": state.state.value, "expires_at": _rfc3339(state.expires_at)}
    if state.lease_until is not None:
        found["lease_until"] = _rfc3339(state.lease_until)
    if state.state is KeyState.COMPLETED:
        found["status"] = state.status
        found["replayable"] = state.replayable
    return found


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
