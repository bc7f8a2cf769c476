"""The outbox relay: committed outbox rows to a Redis Stream, at least once.

A pass locks a batch of unpublished rows (`FOR UPDATE SKIP LOCKED`, so several
relays share the work without waiting on each other), appends each to the stream
with its stable `event_id`, then marks the batch published and commits. A relay
that dies after appending and before committing leaves its rows unpublished: they
are appended again by the next pass, with the same event ids, and consumers drop
what they already handled (see `Consumer`). Sessions run READ COMMITTED (see
gate.db): no gap locks, so two relays do not deadlock on the scan.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from gate.db import Database
from gate.payments.metrics import OUTBOX_LAG, OUTBOX_UNPUBLISHED

log = logging.getLogger("gate.payments.outbox")


class OutboxRelay:
    def __init__(
        self,
        db: Database,
        client: aioredis.Redis,
        stream: str,
        maxlen: int,
        batch_max: int,
        interval_seconds: float,
    ) -> None:
        self.db = db
        self.redis = client
        self.stream = stream
        self.maxlen = maxlen
        self.batch_max = batch_max
        self.interval_seconds = interval_seconds

    async def run_once(self) -> int:
        """Publish at most one batch; returns how many rows it published."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "SELECT id, event_id, topic, aggregate_id, payload, created_at,"
                " TIMESTAMPDIFF(MICROSECOND, created_at, NOW(6)) FROM outbox"
                " WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
                (self.batch_max,),
            )
            rows = await cur.fetchall()
            if not rows:
                await cur.execute("COMMIT")
                return 0
            pipe = self.redis.pipeline(transaction=False)
            for _, event_id, topic, aggregate, payload, created, _lag in rows:
                pipe.xadd(
                    self.stream,
                    {
                        "event_id": str(event_id),
                        "topic": str(topic),
                        "aggregate_id": str(aggregate),
                        "payload": str(payload),
                        "created_at": created.isoformat(timespec="microseconds") + "Z",
                    },
                    maxlen=self.maxlen,
                    approximate=True,
                )
            await pipe.execute()
            ids = [int(r[0]) for r in rows]
            marks = ",".join(["%s"] * len(ids))
            await cur.execute(
                f"UPDATE outbox SET published_at = NOW(6) WHERE id IN ({marks})", tuple(ids)
            )
            await cur.execute("COMMIT")
        for row in rows:
            OUTBOX_LAG.observe(max(0, int(row[6])) / 1e6)
        return len(rows)

    async def unpublished(self) -> int:
        row = await self.db.fetchone("SELECT COUNT(*) FROM outbox WHERE published_at IS NULL")
        count = int(row[0]) if row else 0
        OUTBOX_UNPUBLISHED.set(count)
        return count

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            done = 0
            try:
                done = await self.run_once()
                if done < self.batch_max:
                    await self.unpublished()
            except Exception:
                log.exception("outbox relay pass failed")
            if done >= self.batch_max:
                continue
            try:
                await asyncio.wait_for(stop.wait(), self.interval_seconds)
            except TimeoutError:
                pass


Handler = Callable[[str, str, dict[str, Any]], Awaitable[None]]


class Consumer:
    """A follow-up (mail, coupons, invoices) reading the stream in a consumer group.

    Delivery is at least once; a handler must tolerate seeing an event id again.
    A key per handled event id (kept `seen_ttl_seconds`) makes that the rare case:
    an event id already handled is acknowledged without calling the handler.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        group: str,
        name: str,
        handler: Handler,
        batch_max: int = 100,
        seen_ttl_seconds: int = 7 * 86_400,
    ) -> None:
        self.redis = client
        self.stream = stream
        self.group = group
        self.name = name
        self.handler = handler
        self.batch_max = batch_max
        self.seen_ttl_seconds = seen_ttl_seconds

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run_once(self, block_ms: int = 1000) -> int:
        result: Any = await self.redis.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=self.batch_max, block=block_ms
        )
        handled = 0
        for _, entries in result or []:
            for entry_id, fields in entries:
                f = {
                    (k.decode() if isinstance(k, bytes) else str(k)): (
                        v.decode() if isinstance(v, bytes) else str(v)
                    )
                    for k, v in fields.items()
                }
                seen = f"{self.stream}:seen:{self.group}:{f['event_id']}"
                if not await self.redis.exists(seen):
                    # Handled first, remembered after: a crash in between means the
                    # event is handled again (at least once), never skipped.
                    await self.handler(f["event_id"], f["topic"], f)
                    await self.redis.set(seen, "1", ex=self.seen_ttl_seconds)
                    handled += 1
                await self.redis.xack(self.stream, self.group, entry_id)
        return handled
