"""The outbox relay: at least once, stable event ids, several relays at once.

The relays here are real `gate relay` processes on a scratch database of their own
(no other gate of the suite publishes its rows). To kill a relay exactly between
publishing and marking, its Redis connection goes through a proxy that lets the
commands through but holds Redis's replies back: the XADD has happened in Redis,
the relay waits for the answer with its rows still locked and unmarked, and then
it is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiomysql
import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.inventory.orders import new_id
from gate.payments.outbox import Consumer
from gate.store.db import Database, connect_kwargs, notes_off
from gate.store.migrate import migrate
from tests.support import GATE_BIN, ROOT, base_env, free_port


class ReplyHoldingProxy:
    """TCP proxy to Redis; while `hold` is set, replies are kept back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self.open = asyncio.Event()
        self.open.set()
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gated: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if gated:
                    await self.open.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.target)
        for task in (
            asyncio.ensure_future(self._pump(client_r, server_w, False)),
            asyncio.ensure_future(self._pump(server_r, client_w, True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self.open.set()
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.fixture(scope="module")
async def relay_settings(settings: Settings) -> AsyncIterator[Settings]:
    name = f"{settings.mysql.database}_relay"[:64]
    scratch = dataclasses.replace(
        settings, mysql=dataclasses.replace(settings.mysql, database=name)
    )
    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        async with conn.cursor() as cur:
            await notes_off(cur)
            await cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        conn.close()
    await migrate(scratch.mysql)
    yield scratch


@pytest.fixture
async def relay_db(relay_settings: Settings) -> AsyncIterator[Database]:
    db = Database(relay_settings, pool_max=4)
    await db.start()
    try:
        yield db
    finally:
        await db.close()


def _relay_env(settings: Settings, redis_url: str, stream: str) -> dict[str, str]:
    env = base_env()
    env.update(
        {
            "GATE_MYSQL_URL": f"mysql://root@{settings.mysql.host}:{settings.mysql.port}/"
            f"{settings.mysql.database}",
            "GATE_REDIS_URL": redis_url,
            "GATE_OUTBOX_STREAM": stream,
            "GATE_OUTBOX_INTERVAL_SECONDS": "0.05",
            "GATE_OUTBOX_BATCH_MAX": "50",
            # Long enough that the held-back reply is still awaited when the kill comes.
            "GATE_REDIS_TIMEOUT_SECONDS": "30",
            "GATE_INFLIGHT_MAX_SECONDS": "100",
        }
    )
    return env


def _spawn_relay(env: dict[str, str], name: str, once: bool = False) -> subprocess.Popen[bytes]:
    args = [GATE_BIN, "relay"] + (["--once"] if once else [])
    # The child keeps its own copy of the log's descriptor.
    with open(ROOT / ".local" / f"test-relay-{name}.log", "ab") as log:
        return subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(10)


async def _insert(db: Database, n: int) -> list[str]:
    ids = [new_id() for _ in range(n)]
    async with db.connection() as conn, conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO outbox (event_id, topic, aggregate_id, payload) VALUES (%s, %s, %s, %s)",
            [(i, "test.relay", i, f'{{"n": "{i}"}}') for i in ids],
        )
    return ids


async def _stream_ids(rds: aioredis.Redis, stream: str) -> list[str]:
    entries: Any = await rds.xrange(stream)
    return [fields["event_id"] for _, fields in entries]


async def _until(predicate: Any, timeout_seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def test_relay_killed_between_publish_and_mark_delivers_again(
    relay_settings: Settings, relay_db: Database, rds: aioredis.Redis
) -> None:
    stream = f"gate:test-relay-{new_id()}"
    target = urlsplit(relay_settings.redis_url)
    host, port = target.hostname or "127.0.0.1", target.port or 6379
    redis_db = target.path.lstrip("/") or "0"
    proxy = ReplyHoldingProxy(host, port)
    await proxy.start()
    relay = _spawn_relay(
        _relay_env(relay_settings, f"redis://127.0.0.1:{proxy.port}/{redis_db}", stream), "kill"
    )
    try:
        [first] = await _insert(relay_db, 1)

        async def published(event_id: str) -> bool:
            row = await relay_db.fetchone(
                "SELECT published_at IS NOT NULL FROM outbox WHERE event_id = %s", (event_id,)
            )
            return bool(row and row[0])

        assert await _until(lambda: published(first))
        assert await _stream_ids(rds, stream) == [first]

        proxy.open.clear()
        [second] = await _insert(relay_db, 1)

        async def in_stream() -> bool:
            return second in await _stream_ids(rds, stream)

        assert await _until(in_stream)  # appended in Redis; the relay awaits the reply
        assert not await published(second)
        _stop(relay, signal.SIGKILL)
    finally:
        _stop(relay, signal.SIGKILL)
        await proxy.close()

    # The dead relay's transaction rolls back when the server sees its socket close;
    # the next relay publishes the row again with the same event id.
    env = _relay_env(relay_settings, relay_settings.redis_url, stream)
    deadline = time.monotonic() + 20
    while not await published(second) and time.monotonic() < deadline:
        again = _spawn_relay(env, "again", once=True)
        again.wait(30)
    assert await published(second)
    ids = await _stream_ids(rds, stream)
    assert ids == [first, second, second]
    entries: Any = await rds.xrange(stream)
    assert entries[1][1] == entries[2][1]  # the very same message, twice

    # A consumer sees each event id once.
    handled: list[str] = []

    async def handler(event_id: str, topic: str, fields: dict[str, str]) -> None:
        handled.append(event_id)

    consumer = Consumer(rds, stream, "mailer", "c1", handler)
    await consumer.ensure_group()
    while await consumer.run_once(block_ms=100):
        pass
    assert handled == [first, second]
    await rds.delete(stream)


async def test_several_relays_publish_every_row_once(
    relay_settings: Settings, relay_db: Database, rds: aioredis.Redis
) -> None:
    stream = f"gate:test-relays-{new_id()}"
    env = _relay_env(relay_settings, relay_settings.redis_url, stream)
    ids = await _insert(relay_db, 1500)
    relays = [_spawn_relay(env, f"many-{i}") for i in range(3)]
    try:

        async def all_published() -> bool:
            row = await relay_db.fetchone("SELECT COUNT(*) FROM outbox WHERE published_at IS NULL")
            return bool(row) and int(row[0]) == 0

        assert await _until(all_published, 60)
    finally:
        for r in relays:
            _stop(r)
    published = await _stream_ids(rds, stream)
    assert sorted(published) == sorted(ids)  # every row, none twice (no relay died)
    # The publication order follows the commit order within each batch.
    assert len(set(published)) == len(published)
    await rds.delete(stream)


async def test_a_consumer_skips_nothing_after_a_handler_error_or_a_dead_peer(
    rds: aioredis.Redis,
) -> None:
    stream = f"gate:test-consumer-{new_id()}"
    ids = [new_id() for _ in range(4)]
    for i, event_id in enumerate(ids):
        await rds.xadd(stream, {"event_id": event_id, "topic": "order.paid", "n": str(i)})
    handled: list[str] = []
    fail_once = {ids[0]}

    async def handler(event_id: str, topic: str, fields: dict[str, str]) -> None:
        if event_id in fail_once:
            fail_once.discard(event_id)
            raise RuntimeError("mail server down")
        handled.append(event_id)

    # The handler fails on the first event: the pass raises, and the next pass takes
    # the unacknowledged entries first.
    c1 = Consumer(rds, stream, "mailer", "c1", handler, batch_max=2)
    await c1.ensure_group()
    with pytest.raises(RuntimeError):
        await c1.run_once(block_ms=100)
    assert await c1.run_once(block_ms=100) == 2
    assert handled == ids[:2]

    # c2 reads the next two and dies before acknowledging them.
    read: Any = await rds.xreadgroup("mailer", "c2", {stream: ">"}, count=2)
    assert [e[1]["event_id"] for e in read[0][1]] == ids[2:]
    # c3 claims what c2 left once it has been idle long enough (0 ms here).
    c3 = Consumer(rds, stream, "mailer", "c3", handler, claim_idle_ms=0)
    assert await c3.run_once(block_ms=100) == 2
    assert handled == ids
    pending: Any = await rds.xpending(stream, "mailer")
    assert pending["pending"] == 0

    # A poison event: after attempts_max failures it is acknowledged and the group
    # moves on; it stays in the stream.
    poison = new_id()
    await rds.xadd(stream, {"event_id": poison, "topic": "order.paid"})

    async def broken(event_id: str, topic: str, fields: dict[str, str]) -> None:
        raise RuntimeError("cannot render this mail")

    c4 = Consumer(rds, stream, "mailer", "c4", broken, attempts_max=3)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await c4.run_once(block_ms=100)
    assert await c4.run_once(block_ms=100) == 0
    pending = await rds.xpending(stream, "mailer")
    assert pending["pending"] == 0
    assert await rds.xlen(stream) == 5
    await rds.delete(stream)
