"""The no-Redis policy (`NoRedisPolicy`): with the deal's Redis breaker open, a
reservation either waits for Redis (GATE_REDIS_DOWN_POLICY=reject, the default: 503,
the database is never stampeded) or goes straight to the database behind a small
per-process cap (GATE_REDIS_DOWN_POLICY=database).

    reserve(request)
      ├─ policy "reject", limits that fail closed, the cap reached, a deal with a
      │  waiting room (its admissions live in Redis) ──> 503
      ├─ a paused deal (deals.paused_at, read with the room) ──> 503 SALE_PAUSED
      └─ CALL gate_reserve on a random bucket (no Redis allocation; the procedure
         falls over to the others), a partitioned deal partition by partition while
         each says sold out ──> 201, or the key's own answer, or the refusal
"""

from __future__ import annotations

import asyncio
import random

import pymysql

from gate.base.codes import DbCode
from gate.base.errors import overloaded, sale_paused
from gate.base.settings import Settings
from gate.inventory import orders
from gate.inventory.mirror import Mirror
from gate.reserve.breaker import Breakers
from gate.reserve.buyer_keys import BuyerKeys
from gate.reserve.commit import Committer, reserved_body
from gate.reserve.groups import Row
from gate.reserve.recovery import Recovery
from gate.reserve.refusals import RateLimits
from gate.reserve.replays import Replays
from gate.reserve.request import Reserved, ReserveRequest, fingerprint
from gate.store.db import Database, DbUnavailable, OutcomeUnknown
from gate.store.keys import home_partition


class NoRedisPolicy:
    def __init__(
        self,
        settings: Settings,
        db: Database,
        mirror: Mirror,
        breakers: Breakers,
        limits: RateLimits,
        committer: Committer,
        recovery: Recovery,
        replays: Replays,
        buyer_keys: BuyerKeys,
    ) -> None:
        self.settings = settings
        self.db = db
        self.mirror = mirror
        self.breakers = breakers
        self.limits = limits
        self.committer = committer
        self.recovery = recovery
        self.replays = replays
        self.buyer_keys = buyer_keys
        self._direct_slots = asyncio.Semaphore(settings.redis_down_db_concurrency_max)

    async def reserve(self, req: ReserveRequest) -> Reserved:
        """Redis is failing (the deal's breaker is open)."""
        retry = self.breakers.for_deal(req.deal_id).retry_after_seconds()
        if self.settings.redis_down_policy != "database":
            raise overloaded("Reservations are paused while admission recovers.", retry)
        if self.limits.on and not self.settings.limits_fail_open:
            raise overloaded("Rate limits unavailable; reservations paused.", retry)
        if self._direct_slots.locked():
            raise overloaded("Database fallback at capacity; retry shortly.", retry)
        async with self._direct_slots:
            # A deal's waiting room lives in Redis: without Redis no admission can be
            # checked or spent, so such a deal is paused rather than opened to all.
            if await self._has_room(req.deal_id):
                raise overloaded("Reservations are paused while admission recovers.", retry)
            fp = fingerprint(req.deal_id, req.quantity)
            token = orders.new_id()
            row = await self._commit(req, fp, token)
            db_code = DbCode(int(row[0]))
            if db_code == DbCode.OK:
                self.buyer_keys.forget(req.user_id)
                return Reserved(reserved_body(token, req, row), replayed=False)
            return await self.replays.after_refusal(req, fp, db_code)

    async def _has_room(self, deal_id: int) -> bool:
        """The deal has a waiting room; SALE_PAUSED for a paused deal (its flag in
        Redis cannot be read: the row's is, in the same read)."""
        try:
            room = await self.db.fetchone(
                "SELECT waiting_room IS NOT NULL, paused_at IS NOT NULL FROM deals WHERE id = %s",
                (deal_id,),
            )
        except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
            raise overloaded("Database unavailable; retry shortly.") from None
        if room is not None and int(room[1]) == 1:
            raise sale_paused()
        return room is not None and int(room[0]) == 1

    async def _commit(self, req: ReserveRequest, fp: str, token: str) -> Row:
        """No Redis allocation: a random bucket, and the procedure falls over to the
        others. The resync loop brings Redis back once it answers. A partitioned
        deal's procedure falls over within the bucket's partition only: each
        partition in turn (the buyer's first), while it says sold out."""
        parts = self.mirror.parts.get(req.deal_id, 1)
        nb = self.mirror.bucket_count_of(req.deal_id) if parts > 1 else None
        home = home_partition(req.user_id, parts)
        tries = parts if nb is not None else 1
        for i in range(tries):
            bucket = random.getrandbits(16)
            if nb is not None:
                k = (home + i) % parts
                bucket = k + parts * random.randrange((nb - k + parts - 1) // parts)
            item = self.committer.item(token, req, fp, bucket, None)
            try:
                row = await self.committer.transaction(
                    req.deal_id, item, f"{bucket}:{req.quantity}"
                )
            except OutcomeUnknown as exc:
                row = await self.recovery.resolve(exc, token, None)
            except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
                raise overloaded("Database unavailable; retry shortly.") from None
            if DbCode(int(row[0])) != DbCode.SOLD_OUT:
                break
        return row
