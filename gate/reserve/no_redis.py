"""The no-Redis policy: with the breaker open, a reservation goes straight to the
database behind a small per-process cap (GATE_REDIS_DOWN_POLICY=database); the
default policy answers 503 before reaching here.
"""

from __future__ import annotations

import random

import pymysql

from gate.base.codes import DbCode
from gate.base.errors import from_db, overloaded
from gate.reserve.recovery import Recovery
from gate.reserve.request import (
    Reserved,
    ReserveRequest,
    fingerprint,
)
from gate.stock import orders
from gate.store.db import DbUnavailable, OutcomeUnknown
from gate.store.keys import deal_keys, home_partition


class NoRedisPolicy(Recovery):
    async def _without_redis(self, req: ReserveRequest) -> Reserved:
        """Redis is failing (the breaker is open)."""
        retry = self.breaker_for(req.deal_id).retry_after_seconds()
        if self.settings.redis_down_policy != "database":
            raise overloaded("Reservations are paused while admission recovers.", retry)
        if self._any_limit and not self.settings.limits_fail_open:
            raise overloaded("Rate limits unavailable; reservations paused.", retry)
        if self._direct_slots.locked():
            raise overloaded("Database fallback at capacity; retry shortly.", retry)
        async with self._direct_slots:
            # A deal's waiting room lives in Redis: without Redis no admission can be
            # checked or spent, so such a deal is paused rather than opened to all.
            try:
                room = await self.db.fetchone(
                    "SELECT waiting_room IS NOT NULL FROM deals WHERE id = %s", (req.deal_id,)
                )
            except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
                raise overloaded("Database unavailable; retry shortly.") from None
            if room is not None and int(room[0]) == 1:
                raise overloaded("Reservations are paused while admission recovers.", retry)
            fp = fingerprint(req.deal_id, req.quantity)
            token = orders.new_id()
            # No Redis allocation: a random bucket, and the procedure falls over to
            # the others. The resync loop brings Redis back once it answers. A
            # partitioned deal's procedure falls over within the bucket's partition
            # only: each partition in turn (the buyer's first), while it says sold out.
            parts = self.mirror.parts.get(req.deal_id, 1)
            nb = self.mirror.bucket_count_of(req.deal_id) if parts > 1 else None
            home = home_partition(req.user_id, parts)
            tries = parts if nb is not None else 1
            for i in range(tries):
                bucket = random.getrandbits(16)
                if nb is not None:
                    k = (home + i) % parts
                    bucket = k + parts * random.randrange((nb - k + parts - 1) // parts)
                item = self._item(token, req, fp, bucket, None)
                try:
                    row = await self._transaction(req.deal_id, item, f"{bucket}:{req.quantity}")
                except OutcomeUnknown as exc:
                    row = await self._resolve_unknown(
                        exc, deal_keys(req.deal_id), req, token, redis=False
                    )
                except (DbUnavailable, pymysql.err.MySQLError, TimeoutError):
                    raise overloaded("Database unavailable; retry shortly.") from None
                if DbCode(int(row[0])) != DbCode.SOLD_OUT:
                    break
            db_code = DbCode(int(row[0]))
            if db_code == DbCode.OK:
                self.buyer_keys.forget(req.user_id)
                return Reserved(self._body(token, req, row), replayed=False)
            if db_code == DbCode.DUPLICATE:
                return await self._existing(req, fp)
            # gate_reserve checks the window, stock and quota before it meets the key:
            # a replay (or a mismatch) gets its own answer, whatever the deal's state.
            existing = await self._existing_or_none(req, fp)
            if existing is not None:
                return existing
            raise from_db(db_code)
