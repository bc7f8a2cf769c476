"""The sold-out near-cache (DESIGN lever 4): answer most losers without Redis.

When the admission script says a deal is sold out, this process remembers it for at
most `ttl_seconds` (100 ms by default) together with the set of users ever admitted
to the deal. During that time a reservation from any *other* user, for a quantity
the deal allows per order, is answered "sold out" straight away: such a user cannot
have a successful or running reservation on the deal, so Redis would answer exactly
the same (a larger quantity goes to Redis, which answers 400 first). Users in the set go to Redis as
usual, so an idempotent replay of a successful reservation still gets its 200.

What stays approximate: for up to `ttl_seconds` after units come back (a cancel or
an expiry), this process may still say "sold out" — the staleness DESIGN accepts —
and a buyer who bought one of those returned units through another process may,
within that same window, have a replay answered "sold out" here.

An entry is renewed before it lapses: the first request that finds it in the second
half of its life starts one read of the deal's state (units left, sale window, size
of the buyers set, Redis's clock) and, when the deal is still sold out with the same
buyers, the entry gets a new `ttl_seconds` counted from before that read. Otherwise
every process would send its whole concurrency to Redis at each lapse (every request
in flight during the admission round trip misses), ten times a second per deal;
the staleness bound stays `ttl_seconds` from the last confirmation.

A deal of P > 1 partitions (docs/scale-out.md) is sold out when every partition is:
the reservation path observes it only after all P admissions said so, the buyers
are the union of the partitions' sets, and a renewal reads every partition.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from gate.keys import DealKeys, deal_keys, partition_keys
from gate.redismode import is_cluster, redis_ms

log = logging.getLogger("gate.soldout")

DEALS_MAX = 10_000
# A deal with more buyers than this is not cached: the set would cost more memory
# than the near-cache saves.
BUYERS_MAX = 200_000


class SoldOutCache:
    def __init__(self, client: aioredis.Redis, ttl_seconds: float) -> None:
        self.redis = client
        self._cluster = is_cluster(client)
        self.ttl_seconds = ttl_seconds
        # deal -> (valid until (monotonic), size of the buyers set(s), the set (their
        # union), the deal's max_per_order, its partition count)
        self._entries: dict[int, tuple[float, int, frozenset[int], int, int]] = {}
        self._fetching: dict[int, asyncio.Task[None]] = {}
        self._renewing: dict[int, asyncio.Task[None]] = {}

    def sold_out_for(self, deal_id: int, user_id: int, quantity: int) -> bool:
        """True: answer "sold out" to this user's request now, without Redis."""
        entry = self._entries.get(deal_id)
        if entry is None:
            return False
        left = entry[0] - time.monotonic()
        if left < 0:
            del self._entries[deal_id]
            return False
        if left < self.ttl_seconds / 2 and deal_id not in self._renewing:
            task = asyncio.get_running_loop().create_task(self._renew(deal_id))
            self._renewing[deal_id] = task
        return quantity <= entry[3] and user_id not in entry[2]

    async def _renew(self, deal_id: int) -> None:
        """Extend the entry if the deal is still sold out to the same buyers."""
        entry = self._entries.get(deal_id)
        if entry is not None and entry[4] > 1:
            try:
                await self._renew_parts(deal_id, entry[4])
            except Exception as exc:
                log.info("sold-out near-cache: deal %s not renewed: %r", deal_id, exc)
            finally:
                self._renewing.pop(deal_id, None)
            return
        try:
            keys = deal_keys(deal_id)
            sent = time.monotonic()
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.meta, "avail", "start_ms", "end_ms", "buyers_ok", "max")
                pipe.scard(keys.buyers)
                if not self._cluster:
                    pipe.time()
                replies = await pipe.execute()
            (avail, start_ms, end_ms, buyers_ok, most), buyers = replies[0], replies[1]
            if self._cluster:
                # TIME of the deal's node (a cluster pipeline sends keyless TIME anywhere).
                now_ms = await redis_ms(self.redis, keys.meta)
            else:
                sec, usec = replies[2]
                now_ms = int(sec) * 1000 + int(usec) // 1000
            entry = self._entries.get(deal_id)
            still = (
                entry is not None
                and avail is not None
                and int(avail) <= 0
                and buyers_ok is not None
                and int(buyers) == entry[1]
                # Outside its window the admission answers NOT_ACTIVE, not sold out.
                and int(start_ms or 0) <= now_ms
                and not 0 < int(end_ms or 0) <= now_ms
            )
            if entry is not None and still:
                limit = int(most or 1)
                self._entries[deal_id] = (sent + self.ttl_seconds, entry[1], entry[2], limit, 1)
        except Exception as exc:
            log.info("sold-out near-cache: deal %s not renewed: %r", deal_id, exc)
        finally:
            self._renewing.pop(deal_id, None)

    async def _renew_parts(self, deal_id: int, parts: int) -> None:
        """`_renew` for a partitioned deal: every partition still sold out, within its
        window, with its buyers set the same size as when observed."""
        sent = time.monotonic()
        sizes = 0
        most = None
        for k in range(parts):
            keys = partition_keys(deal_id, k)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.meta, "avail", "start_ms", "end_ms", "buyers_ok", "max")
                pipe.scard(keys.buyers)
                (avail, start_ms, end_ms, buyers_ok, most), size = await pipe.execute()
            now_ms = await redis_ms(self.redis, keys.meta)
            if (
                avail is None
                or int(avail) > 0
                or buyers_ok is None
                or int(start_ms or 0) > now_ms
                or 0 < int(end_ms or 0) <= now_ms
            ):
                return
            sizes += int(size)
        entry = self._entries.get(deal_id)
        if entry is not None and sizes == entry[1]:
            self._entries[deal_id] = (
                sent + self.ttl_seconds,
                sizes,
                entry[2],
                int(most or 1),
                parts,
            )

    def observe(self, deal_id: int, buyers: int, parts: int = 1) -> None:
        """Redis just said the deal is sold out (every partition of it); `buyers` is
        the size of its buyers set, summed over the partitions (-1: a set is not
        complete, so nothing may be cached)."""
        if self.ttl_seconds <= 0 or buyers < 0 or buyers > BUYERS_MAX:
            return
        entry = self._entries.get(deal_id)
        until = time.monotonic() + self.ttl_seconds
        if entry is not None and entry[1] == buyers:
            self._entries[deal_id] = (until, buyers, entry[2], entry[3], entry[4])
            return
        if deal_id not in self._fetching:
            task = asyncio.get_running_loop().create_task(self._fetch(deal_id, parts))
            self._fetching[deal_id] = task

    async def _fetch(self, deal_id: int, parts: int = 1) -> None:
        try:
            members: set[str] = set()
            size = 0
            most = None
            partitions: list[DealKeys] = [partition_keys(deal_id, k) for k in range(parts)]
            for keys in partitions:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.smembers(keys.buyers)
                    # As admit.lua reads it: a quantity above it is a 400, not sold out.
                    pipe.hget(keys.meta, "max")
                    mine, most = await pipe.execute()
                members |= mine
                size += len(mine)
            buyers = frozenset(int(m) for m in members)
            if len(self._entries) >= DEALS_MAX:
                self._entries.clear()
            # The set may have grown since the size was read; its own size is what
            # the next observation compares with (the sum of the partitions' sizes).
            until = time.monotonic() + self.ttl_seconds
            self._entries[deal_id] = (until, size, buyers, int(most or 1), parts)
        except Exception as exc:
            log.info("sold-out near-cache: buyers of deal %s not fetched: %r", deal_id, exc)
        finally:
            self._fetching.pop(deal_id, None)

    def forget(self, deal_id: int) -> None:
        """Units came back in this process (a cancel): stop answering from memory."""
        self._entries.pop(deal_id, None)

    async def aclose(self) -> None:
        tasks = [*self._fetching.values(), *self._renewing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
