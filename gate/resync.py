"""The resync loop: Redis counters converge to the database after any fault.

Each pass computes, per active deal, exactly what Redis should hold from one
database snapshot and the markers of operations in flight (lua/sync_deal.lua,
docs/redis-mirror.md) and moves Redis there by deltas. Passes are idempotent and
commute, so several gates may run them; a short per-deal lock only saves the work
of duplicate passes.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

from gate.codes import SyncCode
from gate.keys import ACTIVE_DEALS, deal_keys
from gate.metrics import METRICS
from gate.mirror import Mirror
from gate.settings import Settings
from gate.worklease import WorkLease

log = logging.getLogger("gate.resync")


class Resync:
    def __init__(self, settings: Settings, client: aioredis.Redis, mirror: Mirror) -> None:
        self.settings = settings
        self.redis = client
        self.mirror = mirror
        # Set by the gate: the pass runs only while this process holds the lease.
        self.work_lease: WorkLease | None = None

    async def run_once(self) -> int:
        """One pass over the active deals; returns how many drifts were repaired."""
        lock_ms = max(50, int(self.settings.resync_interval_seconds * 800))
        repaired = 0
        for raw in await self.redis.smembers(ACTIVE_DEALS):
            deal_id = int(raw)
            if not await self.redis.set(deal_keys(deal_id).sync_lock, "1", nx=True, px=lock_ms):
                continue
            result = await self.mirror.resync(deal_id)
            if result is None:
                log.info("deal %s no longer exists; dropping its Redis state", deal_id)
                await self.mirror.forget(deal_id)
                continue
            code, _detail = result
            METRICS.resync.labels(code.name.lower()).inc()
            if code == SyncCode.APPLIED:
                repaired += 1
        return repaired

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                lease = self.work_lease
                if lease is None or await lease.held(self.settings.resync_interval_seconds):
                    await self.run_once()
            except Exception as exc:
                log.warning("resync pass failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.settings.resync_interval_seconds)
            except TimeoutError:
                pass
        # Stopping: the next process to ask takes the work at once (gate/worklease.py).
        if self.work_lease is not None:
            await self.work_lease.release()
