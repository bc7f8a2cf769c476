"""Standalone Redis or Redis Cluster: which one GATE_REDIS_URL names, the redis-py
client for it, and Redis TIME read from the node that owns a key.

GATE_REDIS_MODE=auto (the default) asks the node once at start-up (`INFO cluster`);
`standalone` and `cluster` skip the question. In cluster mode the URL may name any
node; the database must be 0 (a cluster has no other), and no SELECT is ever sent.

Scores and deadlines compared inside a deal's scripts come from that deal's node
(Lua reads the node's clock). A time the gate reads to compare with them (the
resync's start, the janitor's "now") must come from the same node: the clocks of
two nodes may differ. `redis_ms(client, key)` reads TIME on the node that owns
`key`'s slot (in standalone mode, the one server).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gate.base.redis_url import parse_redis_url
from gate.base.settings import SettingsError

log = logging.getLogger("gate.redis")

MODES = ("auto", "standalone", "cluster")


class RedisModeError(SettingsError):
    """GATE_REDIS_URL / GATE_REDIS_MODE cannot be used together; start-up stops."""


def refuse_cluster_db(url: str) -> None:
    db = parse_redis_url(url).db
    if db != 0:
        raise RedisModeError(
            f"GATE_REDIS_URL names database {db}, but the server is a Redis Cluster node and"
            " a cluster has database 0 only: use redis://host:port/0 (or no database)"
        )
    if parse_redis_url(url).unix_path is not None:
        raise RedisModeError("GATE_REDIS_URL: Redis Cluster cannot be reached over unix://")


def node_url(url: str, host: str, port: int) -> str:
    """`url` (its scheme, credentials, TLS, database) pointed at another node."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{address}"))


def detect_mode(
    url: str, mode: str, timeout_seconds: float, nodes: Sequence[tuple[str, int]] = ()
) -> str:
    """`standalone` or `cluster` for `mode` (auto asks the node: `INFO cluster`; when
    it does not answer, the GATE_REDIS_CLUSTER_NODES `nodes` in turn). Raises
    RedisModeError for a cluster URL naming a database other than 0."""
    if mode == "auto":
        last: Exception | None = None
        for target in [url, *(node_url(url, host, port) for host, port in nodes)]:
            try:
                mode = _asked_mode(target, timeout_seconds)
                break
            except redis.RedisError as exc:
                last = exc
        else:
            # Unreachable now: standalone (start-up then fails or degrades as it does
            # for a standalone Redis that is down), unless cluster nodes are named;
            # otherwise cluster needs the mode set.
            mode = "cluster" if nodes else "standalone"
            log.warning("GATE_REDIS_MODE=auto: Redis unreachable (%r); assuming %s", last, mode)
        if mode == "standalone" and nodes:
            raise RedisModeError(
                "GATE_REDIS_CLUSTER_NODES names Redis Cluster nodes, but Redis is a"
                " standalone server"
            )
    if mode == "cluster":
        refuse_cluster_db(url)
    return mode


def _asked_mode(url: str, timeout_seconds: float) -> str:
    """INFO cluster of the node `url` names (redis.RedisError when it does not answer)."""
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        try:
            info: Any = client.info("cluster")
        finally:
            client.close()
    except redis.ResponseError as exc:
        # A cluster node refuses SELECT of a database other than 0.
        if "SELECT is not allowed in cluster mode" in str(exc):
            return "cluster"
        raise RedisModeError(f"cannot ask Redis which mode it runs in: {exc}") from None
    return "cluster" if int(info.get("cluster_enabled", 0)) == 1 else "standalone"


def make_redis(
    url: str,
    pool_max: int,
    timeout_seconds: float,
    mode: str = "standalone",
    nodes: Sequence[tuple[str, int]] = (),
) -> Any:
    """A client that never retries on its own.

    redis-py retries failed commands by default, timeouts included. A timed-out
    admission may well have run, so re-sending it could take stock twice; the
    in-flight token, not a blind retry, decides what happened. In cluster mode
    redis-py still follows MOVED / ASK (the command did not run) and refreshes its
    slot map after a connection error; it never re-sends after a timeout.
    """
    if mode == "cluster":
        return cast(
            aioredis.Redis,
            RedisCluster.from_url(
                url,
                # More nodes to start from (GATE_REDIS_CLUSTER_NODES) than the URL's.
                startup_nodes=[ClusterNode(host, port) for host, port in nodes] or None,
                decode_responses=True,
                max_connections=pool_max,
                socket_timeout=timeout_seconds,
                socket_connect_timeout=timeout_seconds,
                health_check_interval=0,
                retry=Retry(NoBackoff(), 0),
            ),
        )
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        max_connections=pool_max,
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        health_check_interval=0,
        retry=Retry(NoBackoff(), 0),
    )


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


async def redis_ms(client: Any, key: str) -> int:
    """Redis TIME in ms, read on the node that owns `key` (cluster), or the server."""
    if isinstance(client, RedisCluster):
        await client.initialize()  # a no-op once the slot map is known
        node = client.get_node_from_key(key)
        reply: Any = await client.execute_command("TIME", target_nodes=node)
    else:
        reply = await client.time()
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


async def redis_ms_per_node(client: Any, key: str, seen: dict[str, int]) -> int:
    """redis_ms, read once per node for one pass over many deals (`seen`: node -> ms)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        node = client.get_node_from_key(key)
        name = str(node.name) if node is not None else ""
    else:
        name = ""
    now = seen.get(name)
    if now is None:
        now = seen[name] = await redis_ms(client, key)
    return now
