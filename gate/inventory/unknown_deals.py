"""Unknown deal ids, remembered briefly, so that a flood of them stays off the
database: `GET /v1/deals/{id}`, a reservation and every waiting-room route on a
deal Redis holds no state for ask the database only about ids it may hold.

    request for deal D
      read the deals generation from Redis (one GET, shared by the requests that
      asked while it was on its way and sent after they asked: at most one in
      flight; Redis failing: nothing is remembered, the database is asked as before)
      ├─ generation changed since this process last read it ──> forget everything
      ├─ no ceiling yet (a process just started), or it lapsed ──> read it now: one
      │  SELECT MAX(id) for every request waiting on it (a single flight), so a
      │  fresh process hit by N requests at once asks the database once, not N times
      ├─ D above the ceiling (the highest deal id the database held when last read),
      │  or D itself remembered unknown ──────────────────────────> 404, no database
      └─ otherwise the caller asks the database; "no such deal" ──> remember D (the
         ceiling is renewed in the background before it lapses)

`load` puts it together for a caller that loads deals into Redis (the waiting
room's routes): the guard, then the load (itself one flight per deal id and
process, `Mirror.load`), then "remember D" when the load found nothing.

Deal ids are AUTO_INCREMENT and deals are never deleted, so almost every unknown id
is above the ceiling (a random id is); the rare gap below it (a creation rolled
back) is remembered by id, in a bounded map.

Exactness: `Deals.create` writes a fresh random generation to Redis after its COMMIT
and before it answers 201, and every check reads the generation first and any
database answer it remembers was read after that same generation. So once a
creation has answered, the next request for the new id, in any gate process, sees a
new generation and asks the database. Only when that write fails (Redis failing
during the creation) may a process answer 404 for a created deal, for at most
`ttl_seconds` (entries and the ceiling are dropped when that old).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from gate.base.ids import new_id
from gate.base.singleflight import FreshRead, SingleFlight
from gate.inventory import store
from gate.store.db import Database
from gate.store.keys import DEALS_GENERATION
from gate.store.resp import text

log = logging.getLogger("gate.deals")

UNKNOWN_DEALS_SECONDS = 2.0
UNKNOWN_DEALS_MAX = 10_000


class UnknownDeals:
    def __init__(
        self,
        client: aioredis.Redis,
        db: Database,
        ttl_seconds: float = UNKNOWN_DEALS_SECONDS,
        ids_max: int = UNKNOWN_DEALS_MAX,
    ) -> None:
        self.redis = client
        self.db = db
        self.ttl_seconds = ttl_seconds
        self.ids_max = ids_max
        # The generation everything below belongs to ("": none written yet).
        self._generation: str | None = None
        # (valid until (monotonic), highest deal id the database held)
        self._ceiling: tuple[float, int] | None = None
        self._ids: dict[int, float] = {}  # unknown id below the ceiling -> valid until
        self._renewing: asyncio.Task[None] | None = None
        # One read of the ceiling at a time per generation, shared by its waiters.
        self._ceilings: SingleFlight[str, None] = SingleFlight()
        # One read of the generation in flight at a time (a flood of misses takes one
        # Redis connection, not one each).
        self._generations: FreshRead[str | None] = FreshRead(self._read_generation)

    async def generation(self) -> str | None:
        """The current generation (None: Redis failed; remember nothing), with the
        ceiling read for it if this process holds none that is still valid."""
        generation = await self._current()
        if generation is not None:
            ceiling = self._ceiling
            if ceiling is None or ceiling[0] <= time.monotonic():
                await self._fresh_ceiling(generation)
        return generation

    async def load(self, deal_id: int, loader: Callable[[int], Awaitable[bool]]) -> bool:
        """Load a deal Redis lacks through the guard: False for a deal the database does
        not hold, without asking it when the id is known to be unknown. `loader` is
        the load (`Mirror.load`: one flight per deal id and process)."""
        generation = await self.generation()
        if self.unknown(deal_id, generation):
            return False
        found = await loader(deal_id)
        if not found:
            await self.learn(deal_id, generation)
        return found

    async def _read_generation(self) -> str | None:
        try:
            value = await self.redis.get(DEALS_GENERATION)
        except Exception as exc:
            log.info("deals generation unreadable: %r", exc)
            return None
        return "" if value is None else text(value)

    async def _current(self) -> str | None:
        generation = await self._generations.read()
        if generation is None:
            return None
        if generation != self._generation:
            self._generation = generation
            self._ceiling = None
            self._ids.clear()
        return generation

    async def _fresh_ceiling(self, generation: str) -> None:
        await self._ceilings.run(generation, lambda: self._read_ceiling(generation))

    def unknown(self, deal_id: int, generation: str | None) -> bool:
        """True: the database held no deal `deal_id` at this generation; answer 404."""
        if generation is None or generation != self._generation:
            return False
        now = time.monotonic()
        ceiling = self._ceiling
        if ceiling is not None and ceiling[0] > now:
            if ceiling[0] - now < self.ttl_seconds / 2 and self._renewing is None:
                self._renewing = asyncio.get_running_loop().create_task(self._renew())
            if deal_id > ceiling[1]:
                return True
        until = self._ids.get(deal_id)
        if until is not None:
            if until > now:
                return True
            del self._ids[deal_id]
        return False

    async def learn(self, deal_id: int, generation: str | None) -> None:
        """The database, asked after `generation` was read, holds no deal `deal_id`."""
        if generation is None:
            return
        now = time.monotonic()
        ceiling = self._ceiling
        if ceiling is None or ceiling[0] <= now:
            await self._fresh_ceiling(generation)
            ceiling = self._ceiling
        if generation != self._generation:
            return
        if ceiling is not None and deal_id > ceiling[1]:
            return  # the ceiling covers it
        if len(self._ids) >= self.ids_max:
            self._ids.clear()
        self._ids[deal_id] = now + self.ttl_seconds

    async def created(self) -> None:
        """A deal was just committed: every process must forget its unknown ids."""
        self._generation = None
        self._ceiling = None
        self._ids.clear()
        try:
            await self.redis.set(DEALS_GENERATION, new_id())
        except Exception as exc:
            log.warning(
                "deals generation not written (other gate processes may answer 404 for"
                " the new deal for up to %.1f s): %r",
                self.ttl_seconds,
                exc,
            )

    async def _read_ceiling(self, generation: str) -> None:
        sent = time.monotonic()
        try:
            row = await store.highest_deal_id(self.db)
        except Exception as exc:
            log.info("highest deal id unreadable: %r", exc)
            return
        if row is not None and generation == self._generation:
            self._ceiling = (sent + self.ttl_seconds, int(row[0]))

    async def _renew(self) -> None:
        """Read the ceiling again before it lapses, so that a flood of unknown ids
        never finds it lapsed (every request in flight would then ask the database)."""
        try:
            generation = await self._current()
            if generation is not None:
                await self._fresh_ceiling(generation)
        finally:
            self._renewing = None

    async def aclose(self) -> None:
        task = self._renewing
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
