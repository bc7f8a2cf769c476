"""The in-flight janitor: resolves markers left behind by a gate that died mid-request.

A marker older than `inflight_max_seconds` belongs to a request that has certainly
finished or died (settings guarantee a live request gives up well before).
  * An admission token's order either exists (the transaction committed: confirm)
    or never will (compensate: give the units back).
  * An intent either has ledger rows carrying its id (committed: apply it to Redis)
    or never will (drop it).
Every script acts only if the marker is still there, so the janitor can race the
request itself or another janitor safely.

A marker whose operation the database shows committed needs no such wait: the
outcome is decided, and confirming or applying it is what the request would have
done. The janitor resolves those once they are `janitor_committed_after_seconds`
old, long past any live request's own resolution. This is what clears the markers a
failover to a stale replica brings back (their requests finished after the replica's
copy was taken), so the deal is comparable again within seconds, not after
`inflight_max_seconds`.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from gate.db import Database
from gate.keys import ACTIVE_DEALS, deal_keys
from gate.metrics import METRICS
from gate.mirror import Mirror, parse_marker
from gate.settings import Settings

log = logging.getLogger("gate.janitor")


class Janitor:
    def __init__(self, settings: Settings, db: Database, client: aioredis.Redis, mirror: Mirror):
        self.settings = settings
        self.db = db
        self.redis = client
        self.mirror = mirror

    async def run_once(self) -> int:
        """Resolve at most one batch of orphaned tokens per deal; returns how many."""
        seconds, micros = await self.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        cutoff_ms = now_ms - int(self.settings.inflight_max_seconds * 1000)
        committed_cutoff_ms = now_ms - int(self.settings.janitor_committed_after_seconds * 1000)
        batch = self.settings.janitor_batch_max
        resolved = 0
        for raw in await self.redis.smembers(ACTIVE_DEALS):
            keys = deal_keys(int(raw))
            aged = await self.redis.zrangebyscore(
                keys.inflight_times,
                "-inf",
                max(cutoff_ms, committed_cutoff_ms),
                start=0,
                num=batch,
                withscores=True,
            )
            # redis-py types the reply loosely; WITHSCORES gives (member, score) pairs.
            pairs: list[tuple[str, float]] = [(str(t), float(sc)) for t, sc in aged]  # type: ignore[str-unpack]
            tokens = [t for t, _ in pairs]
            if not tokens:
                continue
            orphaned = {t for t, score in pairs if score <= cutoff_ms}
            records = await self.redis.hmget(keys.inflight, tokens)
            marks = ",".join(["%s"] * len(tokens))
            orders = {
                str(r[0]): str(r[1])
                for r in await self.db.fetchall(
                    f"SELECT id, alloc FROM orders WHERE id IN ({marks})", tuple(tokens)
                )
            }
            ledgered = {
                str(r[0])
                for r in await self.db.fetchall(
                    f"SELECT DISTINCT op_id FROM inventory_ledger WHERE op_id IN ({marks})",
                    tuple(tokens),
                )
            }
            intents: list[tuple[str, bool]] = []
            for token, record in zip(tokens, records, strict=True):
                if record is None:
                    await self.redis.zrem(keys.inflight_times, token)
                    continue
                marker = parse_marker(str(record))
                committed = token in (ledgered if marker.kind == "R" else orders)
                if not committed and token not in orphaned:
                    continue  # its request may still be running: wait for the full age
                if marker.kind == "R":
                    intents.append((token, committed))
                    continue
                if committed:
                    done = await self.mirror.confirm(
                        keys,
                        marker.user_id,
                        marker.idempotency_key,
                        token,
                        marker.fingerprint,
                        orders[token],
                    )
                    action = "confirmed"
                else:
                    done = await self.mirror.compensate(
                        keys, marker.user_id, marker.idempotency_key, token
                    )
                    action = "compensated"
                if done:
                    resolved += 1
                    METRICS.janitor_resolved.labels(action).inc()
                    log.warning(
                        "janitor %s orphaned token %s of deal %s", action, token, keys.deal_id
                    )
            if intents:
                applied = await self.mirror.apply(keys.deal_id, intents)
                resolved += len(intents)
                METRICS.janitor_resolved.labels("intent_applied").inc(applied)
                METRICS.janitor_resolved.labels("intent_dropped").inc(len(intents) - applied)
                log.warning(
                    "janitor resolved %d orphaned intent(s) of deal %s (%d applied)",
                    len(intents),
                    keys.deal_id,
                    applied,
                )
        return resolved

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                resolved = await self.run_once()
            except Exception as exc:
                log.warning("janitor pass failed: %r", exc)
                resolved = 0
            if resolved < self.settings.janitor_batch_max:
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.janitor_interval_seconds)
                except TimeoutError:
                    pass
