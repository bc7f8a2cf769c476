"""The webhooks' background work done once across processes (a work lease,
gate/store/work_lease.py): events into deliveries, deal edges, maintenance.

    run() ── each pass, while this process holds the lease "webhooks":
      fan-out      WebhookStore.fan_out, batch after batch while batches come full:
                   outbox rows (committed with their state change) ──> events with
                   their per-order sequence ──> one delivery per subscribed endpoint;
                   this process's dispatcher is kicked at once
      deal watch   every DEAL_WATCH_SECONDS: each live deal's units summed from
                   deal_buckets; a sold-out edge since the last look becomes
                   deal.sold_out / deal.available_again (WebhookStore.deal_edges)
      maintenance  every MAINTENANCE_SECONDS: endpoints whose every delivery failed
                   for 5 days disabled, old rows purged, the backlog gauges

Every step is safe to run twice at once (a lapsed lease): the fan-out locks the
outbox rows it takes (a second runner waits, then finds them marked), a deal's state
row is locked before its edge is judged, purges delete what is past keeping. When
Redis is unreachable the lease answers yes: the work goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gate.store.work_lease import WorkLease
from gate.webhooks.config import WebhookSettings
from gate.webhooks.metrics import DISABLED, FAILING, FANNED_OUT, OVERDUE, PENDING
from gate.webhooks.store import WebhookStore

log = logging.getLogger("gate.webhooks")

DEAL_WATCH_SECONDS = 1.0
MAINTENANCE_SECONDS = 60.0
# Full batches in a row before the loop lets the rest of the pass run.
BATCHES_PER_PASS_MAX = 20


class FanOut:
    def __init__(
        self,
        store: WebhookStore,
        settings: WebhookSettings,
        lease: WorkLease | None,
        kick: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.lease = lease
        self.kick = kick
        self._deal_cursor = 0
        self._last_deal_watch = -1e9
        self._last_maintenance = -1e9

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                busy = False
                try:
                    if self.lease is None or await self.lease.held(self.settings.interval_seconds):
                        busy = await self.run_once()
                except Exception:
                    log.exception("webhook fan-out pass failed")
                if busy:
                    continue
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.interval_seconds)
                except TimeoutError:
                    pass
        finally:
            if self.lease is not None:
                await self.lease.release()

    async def run_once(self, *, force: bool = False) -> bool:
        """One pass; True when a batch came full (more is waiting)."""
        full = False
        for _ in range(BATCHES_PER_PASS_MAX):
            done = await self.store.db.retrying(lambda: self.store.fan_out(self.settings.batch_max))
            if done:
                FANNED_OUT.inc(done)
                self.kick()
            full = done >= self.settings.batch_max
            if not full:
                break
        now = time.monotonic()
        if force or now - self._last_deal_watch >= DEAL_WATCH_SECONDS:
            self._last_deal_watch = now
            await self.watch_deals()
        if force or now - self._last_maintenance >= MAINTENANCE_SECONDS:
            self._last_maintenance = now
            await self.maintain()
        return full

    async def watch_deals(self) -> int:
        made, self._deal_cursor = await self.store.db.retrying(
            lambda: self.store.deal_edges(self._deal_cursor)
        )
        for deal_id, event_type, sequence in made:
            log.info("webhooks: deal %s %s (sequence %s)", deal_id, event_type, sequence)
        return len(made)

    async def maintain(self) -> None:
        disabled = await self.store.disable_failing()
        if disabled:
            DISABLED.labels("failing").inc(disabled)
            log.warning(
                "webhooks: %d endpoint(s) disabled: every delivery failed for 5 days", disabled
            )
        await self.store.purge(self.settings.retention_days)
        pending, overdue_seconds, failing = await self.store.backlog()
        PENDING.set(pending)
        OVERDUE.set(overdue_seconds)
        FAILING.set(failing)
