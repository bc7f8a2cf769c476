"""Background work once across processes: the kind's lease has one holder at a time,
its holder keeps it, and another process takes it once it lapses."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gate.runtime import Gate
from gate.worklease import WorkLease, lease_key

WAIT_SECONDS = 10.0


async def test_one_holder_at_a_time_and_a_lapsed_lease_is_taken(
    local_gate: Gate, rds: aioredis.Redis
) -> None:
    kind = "test-kind"
    await rds.delete(lease_key(kind))
    first = WorkLease(local_gate.runner, kind, 0.3)
    second = WorkLease(local_gate.runner, kind, 0.3)
    assert await first.held()
    assert not await second.held()
    assert await first.held()  # the holder extends it
    assert await rds.get(lease_key(kind)) == first.owner
    # The holder stops asking: its lease lapses and the other process takes it.
    deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
    while not await second.held():
        assert asyncio.get_running_loop().time() < deadline, "lease never lapsed"
        await asyncio.sleep(0.05)
    assert not await first.held()
    await rds.delete(lease_key(kind))


async def test_zero_turns_leases_off(local_gate: Gate) -> None:
    a = WorkLease(local_gate.runner, "test-off", 0)
    b = WorkLease(local_gate.runner, "test-off", 0)
    assert await a.held() and await b.held()

