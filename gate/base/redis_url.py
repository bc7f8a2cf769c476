"""GATE_REDIS_URL read once for both connections to Redis (the pipelined RESP
connection, gate/store/resp.py, and redis-py's pool): redis-py's own `parse_url` plus
a refusal of what the RESP connection cannot honour, so the two always reach the same
server, database and user. Settings read it at start-up, before any store exists,
with GATE_REDIS_MODE and GATE_REDIS_CLUSTER_NODES (`redis_config`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

# Query parameters both connections honour the same way. Anything else (timeouts,
# TLS options, protocol …) redis-py would apply and this connection would not, so it
# is refused at start-up rather than half-applied.
URL_QUERY_SUPPORTED = ("db", "username", "password")


class RedisUrlError(ValueError):
    """GATE_REDIS_URL cannot be used; the message names the variable."""


@dataclass(frozen=True)
class RedisTarget:
    """Where GATE_REDIS_URL points, as redis-py reads it."""

    host: str
    port: int
    db: int
    tls: bool
    unix_path: str | None = None
    username: str | None = None
    # May be a secret: kept out of the repr.
    password: str | None = field(default=None, repr=False)


def parse_redis_url(url: str, name: str = "GATE_REDIS_URL") -> RedisTarget:
    """redis-py's reading of `url`, or RedisUrlError for what it would read differently
    from what was meant (a port or database that is not a number, an unknown option)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise RedisUrlError(f"{name} must start with redis://, rediss:// or unix://")
    if parts.scheme != "unix":
        try:
            port = parts.port
        except ValueError:
            port = 0
        # redis-py reads port 0 as "no port" and would use 6379.
        if port == 0:
            raise RedisUrlError(f"{name} has a port that is not 1-65535")
    unknown = sorted(set(parse_qs(parts.query, keep_blank_values=True)) - set(URL_QUERY_SUPPORTED))
    if unknown:
        raise RedisUrlError(
            f"{name} has unsupported query parameter(s) {', '.join(unknown)}"
            f" (supported: {', '.join(URL_QUERY_SUPPORTED)})"
        )
    path = parts.path.strip("/")
    if parts.scheme != "unix" and path and not path.isdigit():
        # redis-py silently uses database 0 for /name; refuse instead.
        raise RedisUrlError(f"{name} database must be a number (redis://host:port/N)")
    try:
        kwargs: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise RedisUrlError(f"{name} is not a usable Redis URL: {exc}") from None
    db = kwargs.get("db", 0)
    if not isinstance(db, int) or db < 0:
        raise RedisUrlError(f"{name} database must be a number >= 0")
    connection_class = kwargs.get("connection_class")
    unix = connection_class is UnixDomainSocketConnection
    if unix and not kwargs.get("path"):
        raise RedisUrlError(f"{name} unix:// needs a socket path (unix:///run/redis.sock)")
    return RedisTarget(
        host=str(kwargs.get("host", "localhost")),
        port=int(kwargs.get("port", 6379)),
        db=db,
        tls=connection_class is SSLConnection,
        unix_path=str(kwargs["path"]) if unix else None,
        username=kwargs.get("username") or None,
        password=kwargs.get("password") or None,
    )


REDIS_MODES = ("auto", "standalone", "cluster")
CLUSTER_NODES_MAX = 16
_HOST = re.compile(r"[A-Za-z0-9.:-]{1,253}")


def host_port(item: str) -> tuple[str, int] | None:
    """ "host:port" ("[v6]:port" for IPv6) as (host, port), or None when it is not
    one (a port outside 1-65535 included)."""
    host, sep, port = item.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (sep and _HOST.fullmatch(host) and port.isdigit() and 1 <= int(port) <= 65_535):
        return None
    return host, int(port)


def cluster_nodes(raw: str) -> tuple[tuple[str, int], ...]:
    """GATE_REDIS_CLUSTER_NODES: "host:port" entries ([v6]:port for IPv6), separated by
    spaces or commas; reached with GATE_REDIS_URL's credentials and TLS."""
    nodes: list[tuple[str, int]] = []
    for item in raw.replace(",", " ").split():
        node = host_port(item)
        if node is None:
            raise RedisUrlError(
                f"GATE_REDIS_CLUSTER_NODES: {item!r} is not host:port (entries separated by"
                " spaces or commas)"
            )
        nodes.append(node)
    if len(nodes) > CLUSTER_NODES_MAX:
        raise RedisUrlError(f"GATE_REDIS_CLUSTER_NODES: at most {CLUSTER_NODES_MAX} nodes")
    return tuple(dict.fromkeys(nodes))


@dataclass(frozen=True)
class RedisConfig:
    # May carry a password: kept out of the repr.
    url: str = field(repr=False)
    target: RedisTarget
    # "auto" asks the node (INFO cluster) at start-up; "standalone" or "cluster".
    mode: str
    cluster_nodes: tuple[tuple[str, int], ...]


def redis_config(env: Mapping[str, str]) -> RedisConfig:
    """GATE_REDIS_URL, GATE_REDIS_MODE and GATE_REDIS_CLUSTER_NODES, checked together:
    Redis Cluster has database 0 only and is reached over TCP."""
    url = env.get("GATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    target = parse_redis_url(url)
    mode = env.get("GATE_REDIS_MODE", "auto").strip().lower() or "auto"
    if mode not in REDIS_MODES:
        raise RedisUrlError("GATE_REDIS_MODE must be 'auto', 'standalone' or 'cluster'")
    if mode == "cluster" and target.db != 0:
        raise RedisUrlError(
            f"GATE_REDIS_URL names database {target.db}, but Redis Cluster has database 0"
            " only: use redis://host:port/0 (or no database) with GATE_REDIS_MODE=cluster"
        )
    nodes = cluster_nodes(env.get("GATE_REDIS_CLUSTER_NODES", ""))
    if nodes and mode == "standalone":
        raise RedisUrlError(
            "GATE_REDIS_CLUSTER_NODES names Redis Cluster nodes: not with"
            " GATE_REDIS_MODE=standalone"
        )
    if (nodes or mode == "cluster") and target.unix_path is not None:
        raise RedisUrlError("GATE_REDIS_URL: Redis Cluster cannot be reached over unix://")
    return RedisConfig(url, target, mode, nodes)
