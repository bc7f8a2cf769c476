"""The resync loop: Redis counters converge to the database after any fault.

Each pass computes, per active deal, exactly what Redis should hold from one
database snapshot and the markers of operations in flight (lua/sync_deal.lua,
docs/redis-mirror.md) and moves Redis there by deltas. Passes are idempotent and
commute, so several gates may run them; a short per-deal lock only saves the work
of duplicate passes.

Every deal ever loaded stays active, so a long-lived gate would snapshot each past
sale every second, for good. On one Redis (not a cluster), the loop (not
`run_once`'s other callers) lets quiet deals rest:

    per pass: Redis's run_id (another server: a failover, a restart)
                 └─ changed ──> every deal is due again
    per deal: its state's look (avail, buckets' count, in-flight tokens)
        moved since the last pass, or seen for less than RESYNC_QUIET_AFTER_SECONDS,
        or last synced GATE_RESYNC_QUIET_SECONDS ago or more ──> synced
        otherwise ──> skipped (gate_resync_quiet_skips_total)

A deal in sale moves every second and is synced every pass as before; a quiet
deal's drift (a write lost with nothing else moving, a database edited by hand) is
repaired within GATE_RESYNC_QUIET_SECONDS. A flushed deal's look is gone, which is
a move. Every deal's look is read in one pipeline a pass: a round trip, no snapshot.

A sync walks every in-flight marker of the deal inside one script (lua/sync_deal.lua,
about 2 µs a marker) and looks each up in the database, and a deal in queue mode has
a marker per queued request: a queue of 100,000 blocked Redis for 0.2–0.4 s at every
pass. The same loop therefore paces a deal with many markers:

    per deal: in-flight markers N > RESYNC_MARKERS_PER_SECOND
        ──> synced at most every N / RESYNC_MARKERS_PER_SECOND seconds (at most
            RESYNC_PACE_MAX_SECONDS), skipped meanwhile (gate_resync_paced_skips_total)

so that its walks take a bounded share of Redis (a few per cent), and its drift is
repaired within that period instead of a pass. A synchronous deal's markers are its
requests in progress, far fewer: it is never paced. Pacing applies on Redis Cluster
too; there a failover of the deal's node cannot be told (see above), so a paced deal
is synced again when its period is over, not at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gate.base.codes import SyncCode
from gate.base.metrics import METRICS
from gate.base.settings import Settings
from gate.inventory.mirror import Mirror
from gate.store.keys import ACTIVE_DEALS, deal_keys
from gate.store.work_lease import WorkLease

log = logging.getLogger("gate.resync")

# A deal whose look has not moved for this long is quiet (see the module docstring).
RESYNC_QUIET_AFTER_SECONDS = 60.0
QUIET_TRACKED_MAX = 100_000

# A deal with more in-flight markers than this is synced at most every
# markers / RESYNC_MARKERS_PER_SECOND seconds, and at least every RESYNC_PACE_MAX_SECONDS.
RESYNC_MARKERS_PER_SECOND = 20_000
RESYNC_PACE_MAX_SECONDS = 30.0

PACED_SKIPS = METRICS.counter(
    "gate_resync_paced_skips_total",
    "Deals a resync pass skipped as synced recently for their number of in-flight markers.",
)
QUIET_SKIPS = METRICS.counter(
    "gate_resync_quiet_skips_total",
    "Deals a resync pass skipped as quiet (unchanged in Redis, synced recently enough).",
)


@dataclass
class _Seen:
    look: tuple[Any, ...]
    since: float  # when this look was first seen
    synced: float  # when the deal was last synced


class Resync:
    def __init__(self, settings: Settings, client: aioredis.Redis, mirror: Mirror) -> None:
        self.settings = settings
        self.redis = client
        self.mirror = mirror
        # Set by the gate: the pass runs only while this process holds the lease.
        self.work_lease: WorkLease | None = None
        self.clock: Callable[[], float] = time.monotonic
        # The loop's view of each deal (`_quiet`), and the Redis server it was seen on.
        self._seen: dict[int, _Seen] = {}
        # When the loop last synced each deal (`_paced`).
        self._last_sync: dict[int, float] = {}
        self._server = ""

    async def run_once(self, rest_quiet: bool = False) -> int:
        """One pass over the active deals; returns how many drifts were repaired.
        `rest_quiet` (the loop's passes): quiet deals are skipped until due."""
        lock_ms = max(50, int(self.settings.resync_interval_seconds * 800))
        repaired = 0
        cluster = self.mirror.runner.cluster
        loop_pass = rest_quiet
        # Quiet deals rest on one Redis only: a cluster's INFO answers from any node,
        # so its run_id cannot tell a failover of the node that holds a deal. Deals
        # with many markers are paced on either.
        rest_quiet = loop_pass and self.settings.resync_quiet_seconds > 0 and not cluster
        deal_ids = [int(raw) for raw in await self.redis.smembers(ACTIVE_DEALS)]
        looks: dict[int, tuple[Any, ...]] = {}
        if loop_pass:
            if not cluster:
                await self._same_server()
            looks = await self._looks(deal_ids)
        for deal_id in deal_ids:
            if loop_pass and self._paced(deal_id, looks[deal_id]):
                PACED_SKIPS.inc()
                continue
            if rest_quiet and self._quiet(deal_id, looks[deal_id]):
                QUIET_SKIPS.inc()
                continue
            if not await self.redis.set(deal_keys(deal_id).sync_lock, "1", nx=True, px=lock_ms):
                continue
            result = await self.mirror.resync(deal_id)
            if result is None:
                log.info("deal %s no longer exists; dropping its Redis state", deal_id)
                await self.mirror.forget(deal_id)
                self._seen.pop(deal_id, None)
                self._last_sync.pop(deal_id, None)
                continue
            code, _detail = result
            METRICS.resync.labels(code.name.lower()).inc()
            if code == SyncCode.APPLIED:
                repaired += 1
            if loop_pass:
                self._synced(deal_id)
        return repaired

    async def _same_server(self) -> None:
        """Another Redis server than the last pass's (a failover to a replica, a
        restart): what it holds may be older than what was seen, so every deal is
        due again."""
        server = str((await self.redis.info("server")).get("run_id", ""))
        if server != self._server:
            self._seen.clear()
            self._last_sync.clear()
            self._server = server

    async def _looks(self, deal_ids: list[int]) -> dict[int, tuple[Any, ...]]:
        """Each deal's look, all in one pipeline (one round trip a pass)."""
        pipe = self.redis.pipeline(transaction=False)
        for deal_id in deal_ids:
            keys = deal_keys(deal_id)
            pipe.hmget(keys.meta, ["avail", "nb", "pp"])
            pipe.hlen(keys.inflight)
            pipe.hlen(keys.buckets)
        replies = await pipe.execute()
        return {
            deal_id: (*replies[3 * i], replies[3 * i + 1], replies[3 * i + 2])
            for i, deal_id in enumerate(deal_ids)
        }

    def _quiet(self, deal_id: int, look: tuple[Any, ...]) -> bool:
        """Whether the loop may skip this deal now (see the module docstring)."""
        if self.mirror.parts.get(deal_id, 1) > 1:
            return False  # a partitioned deal's state is in several slots: always synced
        now = self.clock()
        seen = self._seen.get(deal_id)
        if seen is None or seen.look != look:
            if len(self._seen) >= QUIET_TRACKED_MAX:
                self._seen.clear()
            self._seen[deal_id] = _Seen(look, now, -1e18)
            return False
        return (
            now - seen.since >= RESYNC_QUIET_AFTER_SECONDS
            and now - seen.synced < self.settings.resync_quiet_seconds
        )

    def _paced(self, deal_id: int, look: tuple[Any, ...]) -> bool:
        """Whether the loop skips this deal for its number of in-flight markers (see
        the module docstring): synced less than N / RESYNC_MARKERS_PER_SECOND ago."""
        markers = int(look[3] or 0)
        if markers <= RESYNC_MARKERS_PER_SECOND:
            return False
        last = self._last_sync.get(deal_id)
        if last is None:
            return False
        every = min(RESYNC_PACE_MAX_SECONDS, markers / RESYNC_MARKERS_PER_SECOND)
        return self.clock() - last < every

    def _synced(self, deal_id: int) -> None:
        """The deal was synced now. A repair moved its look: the next pass sees the
        move and syncs it once more, then it can rest."""
        now = self.clock()
        seen = self._seen.get(deal_id)
        if seen is not None:
            seen.synced = now
        if len(self._last_sync) >= QUIET_TRACKED_MAX:
            self._last_sync.clear()
        self._last_sync[deal_id] = now

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                lease = self.work_lease
                if lease is None or await lease.held(self.settings.resync_interval_seconds):
                    await self.run_once(rest_quiet=True)
                else:
                    # Another process's passes: start afresh when back.
                    self._seen.clear()
                    self._last_sync.clear()
            except Exception as exc:
                log.warning("resync pass failed: %r", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.settings.resync_interval_seconds)
            except TimeoutError:
                pass
        # Stopping: the next process to ask takes the work at once (gate/store/work_lease.py).
        if self.work_lease is not None:
            await self.work_lease.release()
