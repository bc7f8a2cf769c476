"""GATE_REDIS_URL read once for both connections to Redis (the pipelined RESP
connection, gate/store/resp.py, and redis-py's pool): redis-py's own `parse_url` plus
a refusal of what the RESP connection cannot honour, so the two always reach the same
server, database and user. Settings read it at start-up, before any store exists."""

from __future__ import annotations

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
