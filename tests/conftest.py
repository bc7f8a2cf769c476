"""Session fixtures: a fresh test database and Redis, and real gate processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gate.db import Database
from gate.migrate import migrate
from gate.runtime import Gate
from gate.settings import Settings, load_settings
from tests.support import Client, GateProcess, base_env


@pytest.fixture(scope="session")
def env() -> dict[str, str]:
    return base_env()


@pytest.fixture(scope="session")
def settings(env: dict[str, str]) -> Settings:
    return load_settings(env)


async def _reset(settings: Settings) -> None:
    import aiomysql

    from gate.db import connect_kwargs

    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            await cur.execute("SET SESSION sql_notes = 0")
            await cur.execute(f"DROP DATABASE IF EXISTS `{settings.mysql.database}`")
    finally:
        conn.close()
    await migrate(settings.mysql)
    client = aioredis.Redis.from_url(settings.redis_url)
    await client.flushdb()
    await client.aclose()


@pytest.fixture(scope="session")
def prepared(settings: Settings) -> None:
    asyncio.run(_reset(settings))


@pytest.fixture(scope="session")
def gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """The shared gate: two worker processes, background loops on."""
    proc = GateProcess(env, workers=2)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def local_gate(settings: Settings, gate: GateProcess) -> AsyncIterator[Gate]:
    """An in-process gate without background loops, to drive its parts (mirror,
    sweeper, invariant monitor) directly beside the shared gate process."""
    g = Gate(settings)
    await g.start(background=False)
    try:
        yield g
    finally:
        await g.stop()


@pytest.fixture
async def client(gate: GateProcess) -> AsyncIterator[Client]:
    c = Client(gate.url)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(scope="session")
async def db(settings: Settings, prepared: None) -> AsyncIterator[Database]:
    database = Database(settings, pool_max=20)
    await database.start()
    yield database
    await database.close()


@pytest.fixture(scope="session")
async def rds(settings: Settings, prepared: None) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
    yield client
    await client.aclose()
