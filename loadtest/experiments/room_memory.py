"""Bytes per waiting-room ticket, measured on a real Redis (docs/waiting-room.md).

Fills one scratch deal's room with N tickets through the gate's own join script
(lua/room_ticket.lua, pipelined), then reads MEMORY USAGE of the room's keys and
the server's used_memory before and after, and deletes the scratch keys.

    python -m loadtest room-memory --redis-url redis://127.0.0.1:6379/7 --tickets 1000000

Use a Redis logical database of your own: the scratch deal id is fixed and its keys
are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time

import redis.asyncio as aioredis

from gate.store.keys import deal_keys
from gate.store.scripts import lua_dir

SCRATCH_DEAL = 9_000_000_001
BATCH = 5000


async def measure(url: str, tickets: int, prequeue: bool) -> dict[str, float]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    keys = deal_keys(SCRATCH_DEAL)
    everything = (keys.meta, *keys.room_state, keys.room + ":draw", keys.room_codes)
    try:
        await client.delete(*everything)
        now_ms = int(time.time() * 1000)
        start_ms = now_ms + 3_600_000 if prequeue else 0
        await client.hset(
            keys.meta, mapping={"nb": 1, "avail": 0, "start_ms": start_ms, "end_ms": 0}
        )
        await client.hset(
            keys.room, mapping={"on": "1", "aps": 1000, "ttl_ms": 120_000, "pq_ms": 86_400_000}
        )
        sha = await client.script_load((lua_dir() / "room_ticket.lua").read_text())
        before = int((await client.info("memory"))["used_memory"])
        started = time.perf_counter()
        base = 10**12  # 13-digit user ids, as a large site's would be
        for first in range(0, tickets, BATCH):
            pipe = client.pipeline(transaction=False)
            for user in range(first, min(tickets, first + BATCH)):
                pipe.evalsha(
                    sha,
                    7,
                    keys.room,
                    keys.room_queue,
                    keys.room_tickets,
                    keys.room_admitted,
                    keys.meta,
                    keys.room + ":draw",
                    keys.room_codes,
                    "join",
                    1000,
                    10_000,
                    10,  # failed access codes a minute (none here)
                    base + user,
                    secrets.randbits(50),
                    secrets.token_hex(16),
                    "",  # an open room: no access code
                    "",  # and no challenge
                    "",  # nor a client address (only a code's attempts count by it)
                )
            await pipe.execute()
        elapsed = time.perf_counter() - started
        after = int((await client.info("memory"))["used_memory"])
        queue = int(await client.memory_usage(keys.room_queue, samples=0) or 0)
        records = int(await client.memory_usage(keys.room_tickets, samples=0) or 0)
        assert await client.zcard(keys.room_queue) == tickets
        return {
            "tickets": tickets,
            "queue_bytes_per_ticket": queue / tickets,
            "tickets_hash_bytes_per_ticket": records / tickets,
            "used_memory_bytes_per_ticket": (after - before) / tickets,
            "joins_per_second_pipelined": tickets / elapsed,
        }
    finally:
        await client.unlink(*everything)
        await client.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/7")
    p.add_argument("--tickets", type=int, default=1_000_000)
    p.add_argument("--prequeue", action="store_true", help="random scores (prequeue joiners)")
    args = p.parse_args()
    result = asyncio.run(measure(args.redis_url, args.tickets, args.prequeue))
    for name, value in result.items():
        print(f"{name}: {value:,.1f}")


if __name__ == "__main__":
    main()
