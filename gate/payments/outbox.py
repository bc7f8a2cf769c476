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

import orjson
import redis.asyncio as aioredis

from gate.base.drain import yield_to_sweeper
from gate.payments import store
from gate.payments.metrics import OUTBOX_LAG, OUTBOX_UNPUBLISHED
from gate.store.db import Database
from gate.store.resp import text
from gate.store.scripts import ScriptMissing, lua_dir

log = logging.getLogger("gate.payments.outbox")

PUBLISH_SCRIPT = "outbox_publish"


def publish_source() -> str:
    path = lua_dir() / f"{PUBLISH_SCRIPT}.lua"
    if not path.is_file():
        raise ScriptMissing(f"Lua script {path} is missing; refusing to start")
    return path.read_text(encoding="utf-8")


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
        # One script call per batch (lua/outbox_publish.lua); redis-py loads it again
        # by itself when Redis answers NOSCRIPT (restarted, scripts flushed).
        self._publish = client.register_script(publish_source())

    async def run_once(self) -> int:
        """Publish at most one batch; returns how many rows it published."""
        async with self.db.connection() as conn, conn.cursor() as cur:
            await store.begin(cur)
            rows = [
                orjson.loads(text) for (text,) in await store.lock_unpublished(cur, self.batch_max)
            ]
            if not rows:
                await store.commit(cur)
                return 0
            args: list[Any] = [self.maxlen, len(rows)]
            for row in rows:
                args += row[1:6]
            await self._publish(keys=[self.stream], args=args)
            ids = [int(r[0]) for r in rows]
            await store.mark_published(cur, ids)
            await store.commit(cur)
        for row in rows:
            OUTBOX_LAG.observe(max(0, int(row[6])) / 1e6)
        return len(rows)

    async def unpublished(self) -> int:
        count = await store.unpublished_count(self.db)
        OUTBOX_UNPUBLISHED.set(count)
        return count

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            # A crowd's stock comes back before the events saying so (gate/base/drain.py).
            await yield_to_sweeper(stop)
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
# Entries whose failures a consumer counts at once (each fails the batch it is in, so
# only a few are ever counted; the bound is for a handler that fails on everything).
FAILURES_TRACKED_MAX = 10_000


class Consumer:
    """A follow-up (mail, coupons, invoices) reading the stream in a consumer group.

    Delivery is at least once; a handler must tolerate seeing an event id again.
    A key per handled event id (kept `seen_ttl_seconds`) makes that the rare case:
    an event id already handled is acknowledged without calling the handler.

    Nothing read is skipped: each pass first takes the entries delivered to this
    consumer but never acknowledged (its handler raised, or the process died before
    the acknowledgement and came back under the same name), then those another
    consumer of the group left unacknowledged for `claim_idle_ms` (it died for good;
    XAUTOCLAIM), and only then new ones. An entry whose handler has failed
    `attempts_max` times in this process is logged as an error and acknowledged, so
    one poison event cannot stop the group; it stays in the stream for an operator.
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
        claim_idle_ms: int = 60_000,
        attempts_max: int = 5,
    ) -> None:
        self.redis = client
        self.stream = stream
        self.group = group
        self.name = name
        self.handler = handler
        self.batch_max = batch_max
        self.seen_ttl_seconds = seen_ttl_seconds
        self.claim_idle_ms = claim_idle_ms
        self.attempts_max = attempts_max
        self._failures: dict[str, int] = {}

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run_once(self, block_ms: int = 1000) -> int:
        """Handle one batch; the number of events handed to the handler."""
        entries = await self._read("0", None)
        if not entries:
            claimed: Any = await self.redis.xautoclaim(
                self.stream,
                self.group,
                self.name,
                self.claim_idle_ms,
                start_id="0-0",
                count=self.batch_max,
            )
            entries = list(claimed[1]) if claimed else []
        if not entries:
            entries = await self._read(">", block_ms)
        handled = 0
        for entry_id, fields in entries:
            if fields:
                handled += await self._handle(entry_id, fields)
            else:
                # Trimmed from the stream while pending: nothing left to handle.
                await self.redis.xack(self.stream, self.group, entry_id)
        return handled

    async def _read(self, start: str, block_ms: int | None) -> list[Any]:
        result: Any = await self.redis.xreadgroup(
            self.group, self.name, {self.stream: start}, count=self.batch_max, block=block_ms
        )
        return [entry for _, entries in result or [] for entry in entries]

    async def _handle(self, entry_id: Any, fields: dict[Any, Any]) -> int:
        f = {text(k): text(v) for k, v in fields.items()}
        key = text(entry_id)
        seen = f"{self.stream}:seen:{self.group}:{f['event_id']}"
        handled = 0
        if not await self.redis.exists(seen):
            try:
                # Handled first, remembered after: a crash in between means the event
                # is handled again (at least once), never skipped.
                await self.handler(f["event_id"], f["topic"], f)
            except Exception:
                failures = self._failures.get(key, 0) + 1
                if failures < self.attempts_max:
                    if len(self._failures) >= FAILURES_TRACKED_MAX:
                        self._failures.clear()
                    self._failures[key] = failures
                    raise
                log.error(
                    "outbox consumer %s/%s: event %s failed %d times; acknowledged, left"
                    " in the stream",
                    self.group,
                    self.name,
                    f["event_id"],
                    failures,
                    exc_info=True,
                )
            else:
                await self.redis.set(seen, "1", ex=self.seen_ttl_seconds)
                handled = 1
        self._failures.pop(key, None)
        await self.redis.xack(self.stream, self.group, entry_id)
        return handled
