"""The idempotency keys the database holds for a buyer, remembered briefly, so that a
buyer refused again and again (at their per-user limit, a quantity above the
deal's maximum) re-clicking with fresh keys stays off the database.

    Redis refuses a buyer who was admitted to the deal before (admit.lua's
    "known buyer" flag): the request may be a replay whose Redis record was lost
    ├─ the buyer's keys remembered (younger than ttl_seconds)
    │    ├─ this key not among them ──> the refusal, no database
    │    └─ among them ──────────────> the database look-up (a replay or a mismatch)
    └─ not remembered ──> one read of the buyer's keys (at most keys_max + 1 rows;
       concurrent refusals of one buyer share it), then as above; a buyer with more
       keys than keys_max is not remembered and every refusal asks (as before)

Exactness: an order committed after the read is found in Redis (its key's record,
written by the admission, answers the replay before any refusal), except when it
was committed without Redis (the "database" Redis-down policy) or its record was
lost (a flush) within ttl_seconds of the read; then this process may answer the
refusal instead of the replay for up to ttl_seconds. Likewise a key first used on
another deal (its record is in that deal's slot) through another process within
ttl_seconds gets the refusal here rather than the 422 mismatch; either answer
changes nothing. The reservation path forgets a buyer's entry when it commits an
order for them.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gate.store.db import Database

log = logging.getLogger("gate.reservations")

BUYER_KEYS_SECONDS = 2.0
BUYER_KEYS_USERS_MAX = 10_000
BUYER_KEYS_PER_USER_MAX = 64


class BuyerKeys:
    def __init__(
        self,
        db: Database,
        ttl_seconds: float = BUYER_KEYS_SECONDS,
        users_max: int = BUYER_KEYS_USERS_MAX,
        keys_max: int = BUYER_KEYS_PER_USER_MAX,
    ) -> None:
        self.db = db
        self.ttl_seconds = ttl_seconds
        self.users_max = users_max
        self.keys_max = keys_max
        # user -> (valid until (monotonic), the keys the database holds for them; None:
        # more than keys_max, every refusal asks)
        self._entries: dict[int, tuple[float, frozenset[str] | None]] = {}
        self._reading: dict[int, asyncio.Task[frozenset[str] | None]] = {}

    async def may_hold(self, user_id: int, key: str) -> bool:
        """False: the database held no order with this key for this user when last
        read (at most ttl_seconds ago). True: ask it."""
        entry = self._entries.get(user_id)
        if entry is not None and entry[0] > time.monotonic():
            return entry[1] is None or key in entry[1]
        running = self._reading.get(user_id)
        if running is None:
            running = asyncio.get_running_loop().create_task(self._read(user_id))
            self._reading[user_id] = running
        keys = await asyncio.shield(running)
        return keys is None or key in keys

    async def _read(self, user_id: int) -> frozenset[str] | None:
        sent = time.monotonic()
        try:
            rows = await self.db.fetchall(
                "SELECT idempotency_key FROM orders WHERE user_id = %s LIMIT %s",
                (user_id, self.keys_max + 1),
            )
        except Exception as exc:
            # The caller's own look-up answers (or fails) as before.
            log.info("keys of buyer %s unreadable: %r", user_id, exc)
            return None
        finally:
            self._reading.pop(user_id, None)
        keys = frozenset(str(r[0]) for r in rows) if len(rows) <= self.keys_max else None
        if len(self._entries) >= self.users_max:
            self._entries.clear()
        self._entries[user_id] = (sent + self.ttl_seconds, keys)
        return keys

    def forget(self, user_id: int) -> None:
        """This process committed an order for the buyer."""
        self._entries.pop(user_id, None)

    async def aclose(self) -> None:
        tasks = list(self._reading.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
