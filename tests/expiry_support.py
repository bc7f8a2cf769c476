"""Helpers for the expiry tests: gate commands as real processes, a TCP proxy that can
hold traffic back, holds made through the HTTP API, and waiting for the database."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from gate.store.db import Database
from tests.support import GATE_BIN, Client, reserve


async def make_holds(
    client: Client,
    deal_id: int,
    count: int,
    *,
    user_base: int,
    concurrency: int = 32,
    quantity: int = 1,
) -> list[str]:
    """`count` holds of one deal through the HTTP API (one buyer each); their order ids.
    A 503 is retried with the same idempotency key, as a well-behaved client does."""
    orders: list[str] = []
    queue = list(range(count))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            key = f"hold-{deal_id}-{i:06d}"
            for _ in range(20):
                r = await reserve(client, deal_id, user_base + i, key, quantity)
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.2)
            assert r.status_code in (200, 201), r.text
            orders.append(str(r.json()["order_id"]))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    assert len(orders) == count
    return orders


async def wait_until(
    probe: Callable[[], Awaitable[bool]], timeout_seconds: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def statuses(db: Database, order_ids: Sequence[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for i in range(0, len(order_ids), 1000):
        chunk = tuple(order_ids[i : i + 1000])
        marks = ",".join(["%s"] * len(chunk))
        rows = await db.fetchall(f"SELECT id, status FROM orders WHERE id IN ({marks})", chunk)
        found.update({str(r[0]): str(r[1]) for r in rows})
    return found


async def holding(db: Database, deal_id: int) -> int:
    row = await db.fetchone(
        "SELECT COUNT(*) FROM orders WHERE deal_id = %s"
        " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED')",
        (deal_id,),
    )
    return int(row[0]) if row else 0


def run_gate(env: Mapping[str, str], *args: str, timeout_seconds: float = 60) -> str:
    done = subprocess.run(
        [GATE_BIN, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


RESP_ULID = re.compile(rb"\$26\r\n([0-9A-HJKMNP-TV-Z]{26})\r\n")


class TcpProxy:
    """A TCP proxy in front of Redis that records what clients send and holds back,
    for ever, every client connection from the first chunk that contains `hold`
    onwards (the command never reaches the server, and its caller waits)."""

    def __init__(self, host: str, port: int, hold: bytes | None = None) -> None:
        self.host = host
        self.port = port
        self.hold = hold
        self.sent = bytearray()  # everything forwarded client -> server
        self.held = 0  # connections held back
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    def intent_ids(self) -> set[str]:
        """Every ULID the clients sent (intent ids, for a sweeper)."""
        return {m.decode() for m in RESP_ULID.findall(bytes(self.sent))}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers.extend((writer, up_writer))
        tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer, upstream=True)),
            asyncio.ensure_future(self._pipe(up_reader, writer, upstream=False)),
        ]
        for t in tasks:
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        tail = b""
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                if upstream and self.hold is not None and self.hold in tail + chunk:
                    self.held += 1
                    while await reader.read(65536):  # swallow the rest of the connection
                        pass
                    break
                if upstream:
                    self.sent.extend(chunk)
                    tail = chunk[-len(self.hold) :] if self.hold else b""
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            try:
                w.close()
            except Exception:
                pass
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def redis_target(url: str) -> tuple[str, int, str]:
    """(host, port, "/db") of a redis:// URL."""
    m = re.match(r"^redis://(?:[^@/]*@)?([^:/]+)(?::(\d+))?(/\d+)?$", url)
    assert m, url
    return m[1], int(m[2] or 6379), m[3] or "/0"


async def db_now(db: Database) -> Any:
    row = await db.fetchone("SELECT NOW(6)")
    assert row is not None
    return row[0]
