"""RedisStore's look at its server's settings: eviction, persistence, replicas, the clock.

Read with ``INFO`` (which managed servers allow) and ``CONFIG GET save`` (which some refuse:
then the snapshots are unknown, said in the finding); every primary of a cluster is read.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ResponseError

from idempotency_mw._redis_client import AsyncClient
from idempotency_mw.values.findings import Finding, ServerCheck, Severity

_LOST_WITH_A_PRIMARY = (
    "a primary that fails takes its records with it until it is back, and for good if its "
    "data is lost: their keys run again"
)


async def server_check(client: AsyncClient) -> ServerCheck:
    """The findings about the server (each primary of a cluster) behind ``client``."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        nodes: list[ClusterNode | None] = list(client.get_primaries())
    else:
        nodes = [None]
    # A single server without replicas is a choice; a cluster or a Sentinel promises failover.
    watched = isinstance(client, RedisCluster) or isinstance(
        client.connection_pool, SentinelConnectionPool
    )
    found: dict[Finding, None] = {}
    without_replica = 0
    for node in nodes:
        try:
            findings, replicas = await _server(client, node)
        except ResponseError as exc:  # a proxy or managed server that refuses INFO
            findings, replicas = [_unread(exc)], None
        found.update(dict.fromkeys(findings))
        without_replica += replicas == 0
    if watched and without_replica:
        where = f"{without_replica} of {len(nodes)} primaries" if len(nodes) > 1 else "the primary"
        fix = "a replica of every primary (cluster-replicas 1)" if len(nodes) > 1 else "a replica"
        found[Finding("replicas", f"none for {where}", _LOST_WITH_A_PRIMARY, fix)] = None
    seconds, micros = await client.time()
    return ServerCheck(tuple(found), now=seconds + micros / 1e6)


async def _server(client: AsyncClient, node: ClusterNode | None) -> tuple[list[Finding], int]:
    """The findings about one server, and how many replicas it has."""
    target: dict[str, Any] = {} if node is None else {"target_nodes": node}
    info = await client.info(**target)
    findings = []
    policy = str(info.get("maxmemory_policy", "unknown"))
    if policy != "noeviction":
        findings.append(
            Finding(
                "maxmemory-policy",
                policy,
                "under memory pressure Redis evicts records before their TTL ends (every record "
                "has one), and their keys run again",
                "maxmemory-policy noeviction (or a Redis of the records' own without maxmemory)",
            )
        )
    if not info.get("aof_enabled"):
        try:
            save = (await client.config_get("save", **target)).get("save")
        except ResponseError:  # a managed server that refuses CONFIG
            save = None
        findings.append(_no_append_only(save))
    return findings, int(info.get("connected_slaves", 0))


def _no_append_only(save: str | None) -> Finding:
    if save == "":
        return Finding(
            "appendonly",
            'no, and no snapshots (save "")',
            "a restart forgets every record, and every key runs again",
            "appendonly yes",
        )
    shown = "unknown: the server refuses CONFIG" if save is None else f'"{save}"'
    return Finding(
        "appendonly",
        f"no (snapshots: save {shown})",
        "a crash forgets the records written since the last snapshot, and their keys run again",
        "appendonly yes",
    )


def _unread(exc: ResponseError) -> Finding:
    return Finding(
        "INFO",
        f"refused ({exc})",
        "eviction and persistence could not be checked",
        "check maxmemory-policy noeviction and appendonly yes in the provider's settings",
        Severity.NOTE,
    )
