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

An entry is renewed before it lapses: the first request that finds it past
RENEW_AFTER_SHARE of its life starts one read of the deal's state (units left, sale
window, size of the buyers set, Redis's clock) and, when the deal is still sold out
with the same buyers, the entry gets a new `ttl_seconds` counted from before that
read. Otherwise every process would send its whole concurrency to Redis at each
lapse (every request in flight during the admission round trip misses), ten times a
second per deal; the staleness bound stays `ttl_seconds` from the last confirmation.

    entry made ─────── 40 % ──────────────── lapses (ttl_seconds)
                        └ renewal read ──┐      (20–50 ms under load: it waits
                                         │       for this process's own loop)
               still sold out, same size ┴─▶ valid until read's start + ttl_seconds

A renewal that answers after its entry lapsed puts the entry back (the read is as
fresh as any renewal's), unless this process gave units back meanwhile (`forget`).
Under a sold-out flood a renewal's round trip (then a redis-py pipeline), waiting
behind the process's own requests, took up to 90 ms; started at half of the 100 ms
it came back too late about twice a second, and each lapse sent 64–128 requests to
Redis.

A deal of P > 1 partitions (docs/scale-out.md) is sold out when every partition is:
the reservation path observes it only after all P admissions said so, the buyers
are the union of the partitions' sets, and a renewal reads every partition.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis

from gate.store.keys import DealKeys, partition_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.soldout")

DEALS_MAX = 10_000
# A deal with more buyers than this is not cached: the set would cost more memory
# than the near-cache saves.
BUYERS_MAX = 200_000
# The share of an entry's life after which the first request starts its renewal.
RENEW_AFTER_SHARE = 0.4


class SoldOutCache:
    def __init__(self, client: aioredis.Redis, runner: ScriptRunner, ttl_seconds: float) -> None:
        self.redis = client
        self.runner = runner
        self.ttl_seconds = ttl_seconds
        # deal -> (valid until (monotonic), size of the buyers set(s), the set (their
        # union), the deal's max_per_order, its partition count)
        self._entries: dict[int, tuple[float, int, frozenset[int], int, int]] = {}
        self._fetching: dict[int, asyncio.Task[None]] = {}
        self._renewing: dict[int, asyncio.Task[None]] = {}
        self._renew_below = ttl_seconds * (1.0 - RENEW_AFTER_SHARE)
        # Counts `forget`s: a renewal that began before one must not put back what it
        # took away (the read may predate the units that came back).
        self._forgets = 0

    def sold_out_for(self, deal_id: int, user_id: int, quantity: int) -> bool:
        """True: answer "sold out" to this user's request now, without Redis."""
        entry = self._entries.get(deal_id)
        if entry is None:
            return False
        left = entry[0] - time.monotonic()
        if left < 0:
            del self._entries[deal_id]
            return False
        if left < self._renew_below and deal_id not in self._renewing:
            renewal = self._renew(deal_id, entry, self._forgets)
            task = asyncio.get_running_loop().create_task(renewal)
            self._renewing[deal_id] = task
        return quantity <= entry[3] and user_id not in entry[2]

    async def _renew(
        self, deal_id: int, entry: tuple[float, int, frozenset[int], int, int], forgets: int
    ) -> None:
        """Extend `entry` if the deal (every partition of it) is still sold out, within
        its window, to buyers sets of the same size as when observed; `forgets` is the
        count of `forget`s when the renewal was asked for."""
        try:
            parts = entry[4]
            sent = time.monotonic()
            calls = []
            for k in range(parts):
                keys = partition_keys(deal_id, k)
                calls.append(self.runner.call("soldout_renew", [keys.meta, keys.buyers], ()))
            size = 0
            most = 1
            # Every partition's reply (or failure) taken, so none is left unretrieved.
            replies: list[list[Any]] = []
            for reply in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(reply, BaseException):
                    raise reply
                replies.append(reply)
            for avail, start_ms, end_ms, buyers_ok, limit, buyers, now_ms in replies:
                if (
                    avail is None
                    or int(avail) > 0
                    or buyers_ok is None
                    # Outside its window the admission answers NOT_ACTIVE, not sold out.
                    or int(start_ms or 0) > now_ms
                    or 0 < int(end_ms or 0) <= now_ms
                ):
                    return
                size += int(buyers)
                most = int(limit or 1)
            if size == entry[1]:
                self._confirmed(deal_id, entry, forgets, sent, most)
        except Exception as exc:
            log.info("sold-out near-cache: deal %s not renewed: %r", deal_id, exc)
        finally:
            self._renewing.pop(deal_id, None)

    def _confirmed(
        self,
        deal_id: int,
        entry: tuple[float, int, frozenset[int], int, int],
        forgets: int,
        sent: float,
        most: int,
    ) -> None:
        """A renewal read that began at `sent` found the deal still sold out to the
        buyers of `entry`: valid until `sent + ttl_seconds`, also when the entry lapsed
        while the read was on its way, unless a `forget` came in between. A newer
        entry (another buyers set fetched meanwhile) is left as it is."""
        if forgets != self._forgets:
            return
        current = self._entries.get(deal_id)
        until = sent + self.ttl_seconds
        if current is None:
            if len(self._entries) >= DEALS_MAX:
                return
        elif current[2] is not entry[2]:
            return
        else:
            until = max(until, current[0])
        self._entries[deal_id] = (until, entry[1], entry[2], most, entry[4])

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
        self._forgets += 1
        self._entries.pop(deal_id, None)

    async def aclose(self) -> None:
        tasks = [*self._fetching.values(), *self._renewing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
