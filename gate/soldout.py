"""The sold-out near-cache (DESIGN lever 4): answer most losers without Redis.

When the admission script says a deal is sold out, this process remembers it for at
most `ttl_seconds` (100 ms by default) together with the set of users ever admitted
to the deal. During that time a reservation from any *other* user is answered "sold
out" straight away: such a user cannot have a successful or running reservation on
the deal, so Redis would answer exactly the same. Users in the set go to Redis as
usual, so an idempotent replay of a successful reservation still gets its 200.

What stays approximate: for up to `ttl_seconds` after units come back (a cancel or
an expiry), this process may still say "sold out" — the staleness DESIGN accepts —
and a buyer who bought one of those returned units through another process may,
within that same window, have a replay answered "sold out" here.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from gate.keys import deal_keys

log = logging.getLogger("gate.soldout")

DEALS_MAX = 10_000
# A deal with more buyers than this is not cached: the set would cost more memory
# than the near-cache saves.
BUYERS_MAX = 200_000


class SoldOutCache:
    def __init__(self, client: aioredis.Redis, ttl_seconds: float) -> None:
        self.redis = client
        self.ttl_seconds = ttl_seconds
        # deal -> (valid until (monotonic), size of the buyers set, the set)
        self._entries: dict[int, tuple[float, int, frozenset[int]]] = {}
        self._fetching: dict[int, asyncio.Task[None]] = {}

    def sold_out_for(self, deal_id: int, user_id: int) -> bool:
        """True: answer "sold out" to this user now, without Redis."""
        entry = self._entries.get(deal_id)
        if entry is None:
            return False
        if entry[0] < time.monotonic():
            del self._entries[deal_id]
            return False
        return user_id not in entry[2]

    def observe(self, deal_id: int, buyers: int) -> None:
        """Redis just said the deal is sold out; `buyers` is the size of its buyers
        set (-1: the set is not complete, so nothing may be cached)."""
        if self.ttl_seconds <= 0 or buyers < 0 or buyers > BUYERS_MAX:
            return
        entry = self._entries.get(deal_id)
        until = time.monotonic() + self.ttl_seconds
        if entry is not None and entry[1] == buyers:
            self._entries[deal_id] = (until, buyers, entry[2])
            return
        if deal_id not in self._fetching:
            task = asyncio.get_running_loop().create_task(self._fetch(deal_id))
            self._fetching[deal_id] = task

    async def _fetch(self, deal_id: int) -> None:
        try:
            members = await self.redis.smembers(deal_keys(deal_id).buyers)
            buyers = frozenset(int(m) for m in members)
            if len(self._entries) >= DEALS_MAX:
                self._entries.clear()
            # The set may have grown since the size was read; its own size is what
            # the next observation compares with.
            self._entries[deal_id] = (time.monotonic() + self.ttl_seconds, len(buyers), buyers)
        except Exception as exc:
            log.info("sold-out near-cache: buyers of deal %s not fetched: %r", deal_id, exc)
        finally:
            self._fetching.pop(deal_id, None)

    def forget(self, deal_id: int) -> None:
        """Units came back in this process (a cancel): stop answering from memory."""
        self._entries.pop(deal_id, None)

    async def aclose(self) -> None:
        for task in list(self._fetching.values()):
            task.cancel()
        await asyncio.gather(*self._fetching.values(), return_exceptions=True)
