"""RedisJournal: the client's journal in Redis, one hash per entry, every write one script."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

import redis

from idempotency_mw._redis_client import binary_client
from idempotency_mw.client._closing import ClosedOnExit
from idempotency_mw.client.journals.base import FIELDS, MUTABLE, from_row, to_row
from idempotency_mw.client.values import JournalEntry

# KEYS: the entry's hash, the (name, ref) -> key index, the unsettled sorted set, the sequence.
# ARGV: key, index field ('' without a ref), 'add' or 'save', '1' if settled, name, ref,
# n, n field/value pairs to set, then the fields to delete.
# An entry is stored once, with a new sequence number, name and ref; 'add' returns the key of
# the entry already stored under that key or (name, ref), 'save' then replaces the rest.
_WRITE = """
local key, ref_field = ARGV[1], ARGV[2]
local owner = false
if ref_field ~= '' then owner = redis.call('HGET', KEYS[2], ref_field) end
local seq = redis.call('HGET', KEYS[1], 'seq')
if ARGV[3] == 'add' and (owner or seq) then return owner or key end
if not seq then
    if owner and owner ~= key then
        return redis.error_reply('another operation has this name and ref: ' .. owner)
    end
    seq = redis.call('INCR', KEYS[4])
    redis.call('HSET', KEYS[1], 'key', key, 'seq', seq, 'name', ARGV[5])
    if ref_field ~= '' then
        redis.call('HSET', KEYS[1], 'ref', ARGV[6])
        redis.call('HSET', KEYS[2], ref_field, key)
    end
end
local n = tonumber(ARGV[7])
if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 8, 7 + 2 * n)) end
if #ARGV > 7 + 2 * n then redis.call('HDEL', KEYS[1], unpack(ARGV, 8 + 2 * n)) end
if ARGV[4] == '1' then
    redis.call('ZREM', KEYS[3], key)
else
    redis.call('ZADD', KEYS[3], seq, key)
end
return key
"""
# KEYS: the entry's hash, its lease. ARGV: holder, milliseconds. Redis expires the lease itself.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the lease. ARGV: holder.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisJournal(ClosedOnExit):
    """A :class:`Journal` in Redis, e.g. the server store's.

    Each entry is a hash ``<prefix>op:<key>``, its lease a key ``<prefix>lease:<key>`` that
    Redis expires; ``<prefix>refs`` maps name and ref to keys, ``<prefix>unsettled`` orders
    unsettled keys by ``<prefix>seq``. Give ``url`` (the journal makes a client and closes it
    in :meth:`close`) or ``client``, a sync ``redis.Redis`` with ``decode_responses=False``
    that the journal never closes.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        prefix: str = "idem-journal:",
    ) -> None:
        client, self._owns_client = binary_client(
            url,
            client,
            lambda address: redis.Redis.from_url(address, decode_responses=False),
            owner="RedisJournal",
            holds="entries hold binary request bodies",
        )
        self._client = client
        self._prefix = prefix
        self._write_script = client.register_script(_WRITE)
        self._acquire_script = client.register_script(_ACQUIRE)
        self._release_script = client.register_script(_RELEASE)

    @property
    def client(self) -> redis.Redis:
        """The Redis client the journal runs on."""
        return self._client

    @property
    def prefix(self) -> str:
        """The prefix of every Redis key the journal writes."""
        return self._prefix

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation, or return the one with the same name and ref."""
        stored = self.get(self._write(entry, "add"))
        assert stored is not None
        return stored

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        self._write(entry, "save")

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        return self._entry(cast("dict[bytes, bytes]", self._client.hgetall(self._op(key))))

    def unsettled(self) -> list[JournalEntry]:
        """Entries neither confirmed nor failed, oldest first."""
        keys = cast("list[bytes]", self._client.zrange(f"{self._prefix}unsettled", 0, -1))
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self._op(key.decode()))
        entries = [self._entry(fields) for fields in pipe.execute()]
        return [entry for entry in entries if entry is not None and not entry.state.settled]

    def acquire(self, key: str, holder: str, seconds: float) -> bool:
        """Take or renew the lease on ``key``; ``False`` while another holder's is live."""
        milliseconds = max(1, int(seconds * 1000))
        keys = [self._op(key), self._lease(key)]
        return bool(self._acquire_script(keys=keys, args=[holder, milliseconds]))

    def release(self, key: str, holder: str) -> None:
        """End ``holder``'s lease on ``key``, if it still holds it."""
        self._release_script(keys=[self._lease(key)], args=[holder])

    def close(self) -> None:
        """Close the Redis client, if the journal made it."""
        if self._owns_client:
            self._client.close()

    def _op(self, key: str) -> str:
        return f"{self._prefix}op:{key}"

    def _lease(self, key: str) -> str:
        return f"{self._prefix}lease:{key}"

    def _write(self, entry: JournalEntry, mode: str) -> str:
        row = dict(zip(FIELDS, to_row(entry), strict=True))
        pairs = [part for name in MUTABLE if row[name] is not None for part in (name, row[name])]
        gone = [name for name in MUTABLE if row[name] is None]
        ref_field = "" if entry.ref is None else json.dumps([entry.name, entry.ref])
        keys = [self._op(entry.key), *(self._prefix + k for k in ("refs", "unsettled", "seq"))]
        args = [entry.key, ref_field, mode, "1" if entry.state.settled else "0", entry.name]
        reply = self._write_script(
            keys=keys, args=[*args, entry.ref or "", len(pairs) // 2, *pairs, *gone]
        )
        return bytes(reply).decode()

    @staticmethod
    def _entry(fields: Mapping[bytes, bytes]) -> JournalEntry | None:
        if not fields:
            return None
        values = [fields.get(name.encode()) for name in FIELDS]
        return from_row(
            [
                v if v is None or name.endswith("body") else v.decode()
                for name, v in zip(FIELDS, values, strict=True)
            ]
        )
