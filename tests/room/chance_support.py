"""A sale's measured history for the chance's tests (tests/room/test_room_chance.py,
tests/room/test_buyer_page.py)."""

from __future__ import annotations

import redis.asyncio as aioredis

from gate.room.conversion import ADMISSION_SLOT_MS, Ring
from gate.store.keys import deal_keys


async def evidence(rds: aioredis.Redis, deal_id: int) -> None:
    """A sale's history in the admissions ring, as room_advance.lua and admit.lua
    write it: 60 admissions 40 to 60 s ago, 50 of them spent after about 3 s."""
    seconds, micros = await rds.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    ring = Ring(ADMISSION_SLOT_MS)
    for i in range(60):
        given = now_ms - 40_000 - i * 333
        ring.add(given, "n")
        if i % 6:
            ring.converted(given, given + 3000)
    await rds.hset(deal_keys(deal_id).room_ring, mapping=ring.as_hash())  # type: ignore[arg-type]
