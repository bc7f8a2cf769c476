"""Retiring waiting rooms: the Redis keys of a room that is gone are deleted, so
rooms do not accumulate in Redis's memory (docs/waiting-room.md, "Retirement").

    PUT …/waiting-room null ──> Room.publish(None) ──────────────┐ ZADD LT
    room loop: the sale has ended (room_advance.lua, code 3) ────┘ gate:rooms:retiring
                                                                     deal -> now (ms)
    retire loop, one process at a time (work lease "room-retire"), every
    RETIRE_INTERVAL_SECONDS (at once again while a batch comes back full):
      the entries due now, at most RETIRE_BATCH_MAX
        └─ per deal, room_retire.lua (atomic, judged by Redis TIME):
             room off, or sale over for its admission TTL ──> UNLINK the room's keys
             (its hash, queue, tickets, admissions, expiry index, rate window); the
             deal's own keys (stock, buyers, orders) are never touched
             over, but the TTL not yet passed ──> the entry moved to that time
             live again (room turned back on, sale extended) ──> the entry dropped
        └─ lua/room_retire_done.lua: the entry settled only if nobody scheduled it
           anew meanwhile

A removed room's keys go within RETIRE_INTERVAL_SECONDS; an ended sale's at
ends_at + admission_ttl_seconds (the room loop sees the end within
GATE_ROOM_INTERVAL_MS). Several processes may run the pass at once (the lease
lapsed during a long one): the script's judgement is atomic and deleting twice
deletes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gate.room import metrics
from gate.room.fairness import DRAW_KEEP_MS, draw_key
from gate.store.keys import ROOMS_RETIRING, deal_keys
from gate.store.scripts import ScriptRunner
from gate.store.work_lease import WorkLease

log = logging.getLogger("gate.room")

RETIRE_INTERVAL_SECONDS = 5.0
RETIRE_BATCH_MAX = 100


def now_ms() -> int:
    return int(time.time() * 1000)


async def schedule(redis: Any, deal_id: int) -> None:
    """The deal's room is to be judged for retirement now (an earlier entry stays:
    LT only ever brings an entry forward)."""
    await redis.zadd(ROOMS_RETIRING, {str(deal_id): now_ms()}, lt=True)


class RoomRetirer:
    def __init__(
        self,
        redis: Any,
        runner: ScriptRunner,
        lease: WorkLease | None = None,
        interval_seconds: float = RETIRE_INTERVAL_SECONDS,
        batch_max: int = RETIRE_BATCH_MAX,
    ) -> None:
        self.redis = redis
        self.runner = runner
        self.lease = lease
        self.interval_seconds = interval_seconds
        self.batch_max = batch_max

    async def run_once(self) -> int:
        """Judge at most one batch of due rooms; returns how many were judged (a full
        batch: more may be due)."""
        due = await self.redis.zrangebyscore(
            ROOMS_RETIRING, "-inf", now_ms(), start=0, num=self.batch_max, withscores=True
        )
        for member, score in due:
            deal_id = int(member)
            keys = deal_keys(deal_id)
            deleted, later = await self.runner.call(
                "room_retire",
                (
                    *keys.room_state,
                    keys.meta,
                    draw_key(deal_id),
                    keys.room_codes,
                    keys.room_left,
                ),
                (DRAW_KEEP_MS,),
            )
            if int(deleted):
                metrics.RETIRED.inc()
                log.info("deal %s: waiting room retired, its keys deleted", deal_id)
            settled = str(int(later)) if int(later) > 0 else ""
            await self.runner.call(
                "room_retire_done", (ROOMS_RETIRING,), (deal_id, int(score), settled)
            )
        return len(due)

    async def _pass(self) -> int:
        """One pass under the lease: the entries judged (0 when another process holds
        the work)."""
        lease = self.lease
        if lease is not None and not await lease.held(self.interval_seconds):
            return 0
        return await self.run_once()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                judged = await self._pass()
            except Exception as exc:
                log.warning("room retirement pass failed: %r", exc)
                judged = 0
            if judged < self.batch_max:
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_seconds)
                except TimeoutError:
                    pass
        # Stopping: the next process to ask takes the work at once (gate/store/work_lease.py).
        if self.lease is not None:
            await self.lease.release()
