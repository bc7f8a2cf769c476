"""GATE_REDIS_URL: the hot path's own connection (gate/store/resp.py) and redis-py's pool
read it through one parser, so both reach the same database as the same user; what
the hot path cannot honour is refused at start-up (exit 2 naming the variable).

A Redis server of the test's own (with a password) stands in for a protected one.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from gate.base.redis_url import parse_redis_url
from gate.store.keys import deal_keys
from gate.store.resp import RespConnection
from tests.support import GATE_BIN, GateProcess, create_deal, free_port, reserve
from tests.support import Client as HttpClient

PASSWORD = "s3cret pw/with:odd@chars"
PASSWORD_QUOTED = "s3cret%20pw%2Fwith%3Aodd%40chars"


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real redis-server on a free port that requires a password."""
    port = free_port()
    data: Path = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
            "--requirepass",
            PASSWORD,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            probe = subprocess.run(
                ["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True
            )
            if "NOAUTH" in probe.stdout or "PONG" in probe.stdout:
                break
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def _resp_db(url: str) -> int:
    """The database the hot path's connection is on, as the server reports it."""
    conn = RespConnection(url, 2.0)
    await conn.connect()
    try:
        (info,) = conn.send([("CLIENT", "INFO")])
        return _db_of(str(await info))
    finally:
        conn.close()


async def _redis_py_db(url: str) -> int:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return _db_of(str(await client.execute_command("CLIENT", "INFO")))
    finally:
        await client.aclose()


def _db_of(client_info: str) -> int:
    fields = dict(f.split("=", 1) for f in client_info.split() if "=" in f)
    return int(fields["db"])


@pytest.mark.parametrize(
    "url_template, db",
    [
        # The password as user info, the database as the path.
        ("redis://:{quoted}@127.0.0.1:{port}/3", 3),
        # The password and database as query parameters: redis-py honours both (the
        # query's db wins over the path); the hand parser ignored them.
        ("redis://127.0.0.1:{port}/5?db=6&password={quoted}", 6),
        ("redis://default:{quoted}@127.0.0.1:{port}?db=9", 9),
    ],
)
async def test_both_connections_reach_the_same_database(
    protected_redis: int, url_template: str, db: int
) -> None:
    url = url_template.format(port=protected_redis, quoted=PASSWORD_QUOTED)
    assert parse_redis_url(url).db == db
    assert await _redis_py_db(url) == db
    assert await _resp_db(url) == db


async def test_a_wrong_password_fails_both(protected_redis: int) -> None:
    url = f"redis://127.0.0.1:{protected_redis}/1?password=wrong"
    with pytest.raises((AuthenticationError, ResponseError)):
        await _redis_py_db(url)
    with pytest.raises(ResponseError):
        await _resp_db(url)


def test_the_parser_reads_tls_and_unix_sockets() -> None:
    tls = parse_redis_url("rediss://u:p%40ss@redis.example:6380/2")
    assert (tls.tls, tls.host, tls.port, tls.db, tls.username, tls.password) == (
        True,
        "redis.example",
        6380,
        2,
        "u",
        "p@ss",
    )
    unix = parse_redis_url("unix:///run/redis/redis.sock?db=4&password=x")
    assert (unix.unix_path, unix.db, unix.password, unix.tls) == (
        "/run/redis/redis.sock",
        4,
        "x",
        False,
    )
    assert "p@ss" not in repr(tls)


@pytest.mark.parametrize(
    "url, message",
    [
        (
            "redis://127.0.0.1:6379/6?ssl_cert_reqs=none",
            "unsupported query parameter(s) ssl_cert_reqs",
        ),
        (
            "redis://127.0.0.1:6379/6?socket_timeout=5",
            "unsupported query parameter(s) socket_timeout",
        ),
        ("redis://127.0.0.1:6379/cache", "GATE_REDIS_URL database must be a number"),
        ("redis://127.0.0.1:6379/6?db=x", "GATE_REDIS_URL is not a usable Redis URL"),
        ("redis://127.0.0.1:0/6", "GATE_REDIS_URL has a port that is not 1-65535"),
        ("unix://", "GATE_REDIS_URL unix:// needs a socket path"),
        ("http://127.0.0.1:6379/6", "GATE_REDIS_URL must start with redis://"),
    ],
)
def test_unsupported_urls_stop_start_up(env: dict[str, str], url: str, message: str) -> None:
    for args in (("serve", "--port", "1"), ("check",)):
        out = subprocess.run(
            [GATE_BIN, *args],
            env={**env, "GATE_REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr, (args, out.stderr)


async def test_a_gate_on_a_query_string_url_reserves_and_mirrors(
    env: dict[str, str], prepared: None, protected_redis: int
) -> None:
    """The whole gate on `?db=&password=`: the admission script (the hot path's own
    connection) and the mirror (redis-py) both work on database 6 of the protected
    server: the script runner honours both, so reservations succeed."""
    url = f"redis://127.0.0.1:{protected_redis}?db=6&password={PASSWORD_QUOTED}"
    gate = GateProcess({**env, "GATE_REDIS_URL": url})
    try:
        gate.wait_ready()
        client = HttpClient(gate.url)
        try:
            deal_id = await create_deal(client, stock=3, buckets=1)
            resp = await reserve(client, deal_id, 880_001, "redis-url-001")
            assert resp.status_code == 201, resp.text
        finally:
            await client.close()
        rds = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            keys = deal_keys(deal_id)
            assert await rds.exists(keys.meta, keys.buckets) == 2
        finally:
            await rds.aclose()
        check = await asyncio.to_thread(
            subprocess.run,
            [GATE_BIN, "check", "--deal", str(deal_id)],
            env={**env, "GATE_REDIS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert "available=2 held=1 sold=0" in check.stdout, check.stdout
    finally:
        gate.stop()
