"""Background work once across processes: the kind's lease has one holder at a time,
its holder keeps it for as long as its loop pauses, another process takes it once it
lapses, a pass runs when Redis cannot be asked, and what a process knows alone (its
own sweeper's failures) is still evaluated by every process."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gate.base.metrics import METRICS
from gate.expiry.invariant_monitor import InvariantMonitor, MonitorConfig
from gate.expiry.sweeper import STATS
from gate.runtime import Gate
from gate.store.redis_mode import make_redis
from gate.store.scripts import ScriptRunner, read_scripts
from gate.store.work_lease import WorkLease, lease_key
from tests.support import GateProcess, free_port

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


async def test_the_lease_covers_the_loops_pause(local_gate: Gate, rds: aioredis.Redis) -> None:
    """A loop that pauses longer than the configured TTL (the invariant monitor: 10 s)
    must still find its lease when it asks again, or every process would take it in
    turn."""
    kind = "test-cover"
    await rds.delete(lease_key(kind))
    lease = WorkLease(local_gate.runner, kind, 0.5)
    assert await lease.held(cover_seconds=20)
    ttl_ms = await rds.pttl(lease_key(kind))
    assert 20_000 < ttl_ms <= 20_500, ttl_ms
    await rds.delete(lease_key(kind))


async def test_zero_turns_leases_off(local_gate: Gate) -> None:
    a = WorkLease(local_gate.runner, "test-off", 0)
    b = WorkLease(local_gate.runner, "test-off", 0)
    assert await a.held() and await b.held()


async def test_a_pass_runs_when_redis_cannot_be_asked() -> None:
    # Nothing listens on this port: the lease cannot be asked, the pass runs.
    url = f"redis://127.0.0.1:{free_port()}/0"
    client = make_redis(url, 2, 0.5)
    runner = ScriptRunner(client, read_scripts(), 16, url, 0.5)
    try:
        lease = WorkLease(runner, "test-down", 5)
        assert await lease.held(cover_seconds=1)
    finally:
        await runner.aclose()
        await client.aclose()


async def test_the_shared_gate_holds_each_background_lease_once(
    gate: GateProcess, rds: aioredis.Redis
) -> None:
    """Leases are on by default: the shared gate (two workers; two gates on a cluster
    run) runs each loop in one process, whose lease lasts its interval plus the TTL."""
    deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
    owners = {}
    for kind in ("janitor", "resync", "invariants"):
        while (owner := await rds.get(lease_key(kind))) is None:
            assert asyncio.get_running_loop().time() < deadline, kind
            await asyncio.sleep(0.05)
        owners[kind] = owner
        assert 0 < await rds.pttl(lease_key(kind)) <= (10 + 5) * 1000
    # One owner id per loop, never shared between kinds.
    assert len(set(owners.values())) == 3


async def test_a_process_without_the_lease_still_evaluates_its_own_sweeper(
    local_gate: Gate, rds: aioredis.Redis
) -> None:
    """The deal checks run in the lease's holder only, but a sweeper's failures are
    known to its own process only (STATS): a process that skips the checks still
    evaluates its release-failure ratio and alert."""
    kind = "test-invariants"
    await rds.delete(lease_key(kind))
    holder = WorkLease(local_gate.runner, kind, 30)
    assert await holder.held()
    monitor = InvariantMonitor(local_gate.db, local_gate.redis, MonitorConfig(interval_seconds=0.1))
    monitor.work_lease = WorkLease(local_gate.runner, kind, 30)
    stop = asyncio.Event()
    task = asyncio.create_task(monitor.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
        while not monitor._window.samples:
            assert asyncio.get_running_loop().time() < deadline, "never evaluated"
            await asyncio.sleep(0.05)
        STATS.failed += 1  # what a failed release of this process's sweeper adds
        while not monitor.release_failures.firing:
            assert asyncio.get_running_loop().time() < deadline, "failure never seen"
            await asyncio.sleep(0.05)
        ratio = METRICS.registry.get_sample_value("gate_release_failure_ratio")
        assert ratio is not None and ratio > 0
        # The deals were left to the holder.
        assert monitor._books == {}
        assert await rds.get(lease_key(kind)) == holder.owner
    finally:
        stop.set()
        await task
        await rds.delete(lease_key(kind))


async def test_a_stopping_loop_gives_its_lease_back(local_gate: Gate, rds: aioredis.Redis) -> None:
    """A rolling restart pauses nothing: the stopping holder deletes its own lease (and
    only its own), so the next process to ask takes the work at once."""
    kind = "test-release"
    await rds.delete(lease_key(kind))
    janitor = local_gate.janitor
    janitor.work_lease = WorkLease(local_gate.runner, kind, 30)
    stop = asyncio.Event()
    task = asyncio.create_task(janitor.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
        while await rds.get(lease_key(kind)) != janitor.work_lease.owner:
            assert asyncio.get_running_loop().time() < deadline, "lease never taken"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert await rds.get(lease_key(kind)) is None
    # Another process's lease is left alone.
    other = WorkLease(local_gate.runner, kind, 30)
    assert await other.held()
    await janitor.work_lease.release()
    assert await rds.get(lease_key(kind)) == other.owner
    await rds.delete(lease_key(kind))
