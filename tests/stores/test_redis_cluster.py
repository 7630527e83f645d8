"""RedisStore on a real local Redis Cluster: slots, a client that decodes, a master killed."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import anyio
import pytest
import redis.asyncio
from redis.crc import key_slot

from idempotency_mw import ClaimOutcome, ConfigurationError, RedisStore, StoredResponse, StoreError
from tests.support.redis_servers import RedisCluster, redis_cli

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

RESPONSE = StoredResponse(201, ((b"content-type", b"text/plain"),), b"made")


def slot_owners(cluster: RedisCluster) -> dict[int, int]:
    """Which master (its port) serves each slot, as ``CLUSTER NODES`` says."""
    owners: dict[int, int] = {}
    for line in redis_cli(cluster.nodes[0].port, "CLUSTER", "NODES").splitlines():
        fields = line.split()
        address, flags = fields[1], fields[2].split(",")
        if "master" not in flags or "fail" in flags:
            continue
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        for ranged in fields[8:]:
            first, _, last = ranged.partition("-")
            owners.update(dict.fromkeys(range(int(first), int(last or first) + 1), port))
    return owners


async def test_records_spread_over_every_master_one_slot_each(redis_cluster: RedisCluster) -> None:
    store = RedisStore(redis_cluster.url, cluster=True, prefix=f"test-{uuid.uuid4().hex}:")
    try:
        await store.startup()
        keys = [f"k{i}" for i in range(60)]
        for key in keys:
            claim = await store.claim("s", key, "f", ttl=60, lease=60)
            assert claim.token
            assert await store.complete("s", key, claim.token, RESPONSE, ttl=60)
        owners = slot_owners(redis_cluster)
        masters = {owners[key_slot(store.redis_key("s", key).encode())] for key in keys}
        assert len(masters) == 3
        for key in keys:
            assert (await store.claim("s", key, "f", ttl=60, lease=60)).response == RESPONSE
    finally:
        await store.aclose()


async def test_a_cluster_client_that_decodes_is_refused(redis_cluster: RedisCluster) -> None:
    client = redis.asyncio.RedisCluster.from_url(redis_cluster.url, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError, match="decode_responses=False"):
            RedisStore(client=client)
    finally:
        await client.aclose()
    with pytest.raises(ConfigurationError, match="cluster=True"):
        RedisStore(client=client, cluster=True)


async def test_the_store_recovers_when_a_master_is_killed(tmp_path: Path) -> None:
    with RedisCluster.start(tmp_path / "cluster") as cluster:
        store = RedisStore(cluster.url, cluster=True, socket_timeout=1, prefix="failover:")
        try:
            await store.startup()
            victim = cluster.masters()[1]
            owners = slot_owners(cluster)
            # Records on the master that will die, settled before it dies.
            on_victim = [
                key
                for key in (f"k{i}" for i in range(300))
                if owners[key_slot(store.redis_key("s", key).encode())] == victim.port
            ][:20]
            for key in on_victim:
                claim = await store.claim("s", key, "f", ttl=600, lease=600)
                assert claim.token
                assert await store.complete("s", key, claim.token, RESPONSE, ttl=600)
            # Replication is asynchronous: the replica that takes over must have them.
            await anyio.to_thread.run_sync(cluster.wait_for_replication, victim)

            cluster.kill(victim)
            began = time.monotonic()
            while True:
                try:
                    replay = await store.claim("s", on_victim[0], "f", ttl=600, lease=600)
                    break
                except StoreError:  # the master is gone, no replica has taken over yet
                    assert time.monotonic() - began < 30, "no replica took over in 30 s"
                    await anyio.sleep(0.1)
            # The replica that took over serves the records it had received, and new claims.
            assert replay.response == RESPONSE
            for key in on_victim:
                claim = await store.claim("s", key, "f", ttl=600, lease=600)
                assert claim.outcome is ClaimOutcome.REPLAY
            fresh = await store.claim("s", f"after-{uuid.uuid4().hex}", "f", ttl=60, lease=60)
            assert fresh.token
            assert victim.port not in {node.port for node in cluster.masters()}
        finally:
            await store.aclose()
