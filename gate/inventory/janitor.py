"""The in-flight janitor: resolves markers left behind by a gate that died mid-request.

A marker older than `inflight_max_seconds` belongs to a request that has certainly
finished or died (settings guarantee a live request gives up well before).
  * An admission token's order either exists (the transaction committed: confirm)
    or never will (compensate: give the units back).
  * An intent either has ledger rows carrying its id (committed: apply it to Redis)
    or never will (drop it).
Every script acts only if the marker is still there, so the janitor can race the
request itself or another janitor safely.

A marker whose operation the database shows committed needs no such wait: the
outcome is decided, and confirming or applying it is what the request would have
done. The janitor resolves those once they are `janitor_committed_after_seconds`
old, long past any live request's own resolution. This is what clears the markers a
failover to a stale replica brings back (their requests finished after the replica's
copy was taken), so the deal is comparable again within seconds, not after
`inflight_max_seconds`.

A token whose admitting process is dead needs no wait either (a
SIGKILLed gate left its units unbuyable for 30 s). Each token names its process's
liveness lease (gate/store/process_lease.py); once that lease has lapsed:

    owner's lease gone ──> kill the owner's recorded server threads, wait until the
    server shows them gone (none left: nothing of the owner can commit any more)
        ──> look the orders up ──> committed: confirm; not: compensate
    a thread not gone in time, or the owner's connection record missing
        ──> nothing now; the next pass tries again, the age rule still applies

A thread id means something on the server that issued it only. With several database
hosts (gate/store/dbwriter.py) each recorded thread names its node ("id@host:port"): the
current writer's are killed here; a former writer's are ended on that node, or, when
it no longer answers, counted gone once the cluster has dropped it, and the new
writer then applies everything the cluster committed before the look-ups
(Database.wait_thread_gone). None is ever killed on another server.

The lease alone never gives units back: a process that merely missed renewals (a
stalled event loop) has its transactions ended first, and the database's answer after
that is final (docs/redis-mirror.md, "A dead gate's markers").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import pymysql
import redis.asyncio as aioredis

from gate.base.metrics import METRICS
from gate.base.settings import Settings
from gate.inventory import store
from gate.inventory.mirror import Marker, Mirror, parse_marker
from gate.store.db import Database, errno_of
from gate.store.keys import ACTIVE_DEALS, DealKeys, deal_keys, owner_keys
from gate.store.process_lease import parse_thread_field
from gate.store.redis_mode import redis_ms, redis_ms_per_node
from gate.store.work_lease import WorkLease

log = logging.getLogger("gate.janitor")

# How long one pass waits for a dead owner's killed threads to end (the next pass
# tries again), and how many owners it remembers as proven gone.
THREADS_GONE_WAIT_SECONDS = 2.0
GONE_OWNERS_MAX = 10_000
ER_NO_SUCH_THREAD = 1094
ER_KILL_DENIED = 1095


class Janitor:
    def __init__(self, settings: Settings, db: Database, client: aioredis.Redis, mirror: Mirror):
        self.settings = settings
        self.db = db
        self.redis = client
        self.mirror = mirror
        # Owners whose lease lapsed and whose threads were seen gone: that never
        # changes (a lapsed lease is never renewed; a process takes a new owner id).
        self._gone: dict[str, None] = {}
        # Set by the gate: the pass runs only while this process holds the lease.
        self.work_lease: WorkLease | None = None

    async def run_once(self) -> int:
        """Resolve at most one batch of orphaned tokens per deal; returns how many."""
        batch = self.settings.janitor_batch_max
        resolved = 0
        # "Now" is read on the node that owns each deal's slot (once per node and
        # pass): the markers' scores come from that node's clock.
        now_by_node: dict[str, int] = {}
        # Each partition of a partitioned deal is a state of its own (docs/scale-out.md).
        states: list[DealKeys] = []
        for raw in await self.redis.smembers(ACTIVE_DEALS):
            deal_id = int(raw)
            parts = await self.mirror.partitions(deal_id)
            states += [deal_keys(deal_id)] if parts == 1 else self.mirror.keys_of(deal_id, parts)
        for keys in states:
            now_ms = await redis_ms_per_node(self.redis, keys.meta, now_by_node)
            cutoff_ms = now_ms - int(self.settings.inflight_max_seconds * 1000)
            committed_cutoff_ms = now_ms - int(self.settings.janitor_committed_after_seconds * 1000)
            # Young markers too: their owners decide whether they can wait.
            aged = await self.redis.zrangebyscore(
                keys.inflight_times, "-inf", now_ms, start=0, num=batch, withscores=True
            )
            # redis-py types the reply loosely; WITHSCORES gives (member, score) pairs.
            pairs: list[tuple[str, float]] = [(str(t), float(sc)) for t, sc in aged]  # type: ignore[str-unpack]
            if not pairs:
                continue
            orphaned = {t for t, score in pairs if score <= cutoff_ms}
            records = await self.redis.hmget(keys.inflight, [t for t, _ in pairs])
            markers: dict[str, Marker] = {}
            for (token, _), record in zip(pairs, records, strict=True):
                if record is None:
                    await self.redis.zrem(keys.inflight_times, token)
                else:
                    markers[token] = parse_marker(str(record))
            # Proven before the look-ups below, so that they read the final outcome.
            dead = await self.dead_owners(m.owner for m in markers.values() if m.owner)
            tokens = [
                t
                for t, score in pairs
                if t in markers and (score <= committed_cutoff_ms or markers[t].owner in dead)
            ]
            if not tokens:
                continue
            orders = {str(r[0]): str(r[1]) for r in await store.order_allocs(self.db, tokens)}
            ledgered = {str(r[0]) for r in await store.ledgered_ops(self.db, tokens)}
            intents: list[tuple[str, bool]] = []
            for token in tokens:
                marker = markers[token]
                committed = token in (ledgered if marker.kind == "R" else orders)
                if not committed and token not in orphaned and marker.owner not in dead:
                    continue  # its request may still be running: wait for the full age
                if marker.kind == "R":
                    intents.append((token, committed))
                    continue
                if committed:
                    done = await self.mirror.confirm(
                        keys,
                        marker.user_id,
                        marker.idempotency_key,
                        token,
                        marker.fingerprint,
                        orders[token],
                    )
                    action = "confirmed"
                else:
                    done = await self.mirror.compensate(
                        keys, marker.user_id, marker.idempotency_key, token
                    )
                    action = "compensated"
                if done:
                    resolved += 1
                    METRICS.janitor_resolved.labels(action).inc()
                    log.warning(
                        "janitor %s orphaned token %s of deal %s%s",
                        action,
                        token,
                        keys.deal_id,
                        f" (its gate {marker.owner} is gone)" if marker.owner in dead else "",
                    )
            if intents:
                applied = await self.mirror.apply_keys(keys, intents)
                resolved += len(intents)
                METRICS.janitor_resolved.labels("intent_applied").inc(applied)
                METRICS.janitor_resolved.labels("intent_dropped").inc(len(intents) - applied)
                log.warning(
                    "janitor resolved %d orphaned intent(s) of deal %s (%d applied)",
                    len(intents),
                    keys.deal_id,
                    applied,
                )
        return resolved

    async def dead_owners(self, owners: Iterable[str]) -> set[str]:
        """The owners among these whose lease has lapsed and whose server threads are
        all gone: nothing of theirs can commit any more."""
        named = set(owners)
        dead = {o for o in named if o in self._gone}
        unknown = sorted(named - dead)
        if not unknown:
            return dead
        pipe = self.redis.pipeline(transaction=False)
        for owner in unknown:
            pipe.exists(owner_keys(owner).lease)
        for owner, alive in zip(unknown, await pipe.execute(), strict=True):
            if alive:
                continue
            if await self._threads_gone(owner):
                if len(self._gone) >= GONE_OWNERS_MAX:
                    del self._gone[next(iter(self._gone))]
                self._gone[owner] = None
                dead.add(owner)
        return dead

    async def _threads_gone(self, owner: str) -> bool:
        """Kill the recorded server threads of an owner whose lease lapsed and wait
        until the server shows none of them. False when that cannot be shown now."""
        record = await self.redis.hgetall(owner_keys(owner).conns)
        if not record:
            # Expired or lost: which threads it used is unknown; the age rule decides.
            return False
        # A thread id is ended only on the server that issued it: the current writer's
        # here, a former writer's on that node (Database.wait_thread_gone).
        recorded = [(parse_thread_field(str(f)), int(ms)) for f, ms in record.items() if f != "_"]
        here = (None, self.db.node)
        threads = {t: ms for (t, node), ms in recorded if node in here}
        elsewhere = [(t, node, ms) for (t, node), ms in recorded if node not in here]
        if threads or elsewhere:
            # The record's times come from the owner's lease script, on its slot's node.
            now_ms = await redis_ms(self.redis, owner_keys(owner).conns)
        for thread_id, node, ms in elsewhere:
            age_seconds = (now_ms - ms) / 1000
            if not await self.db.wait_thread_gone(
                thread_id, age_seconds, THREADS_GONE_WAIT_SECONDS, node=node
            ):
                return False
        if threads:
            row = await self.db.fetchone("SHOW GLOBAL STATUS LIKE 'Uptime'")
            uptime_seconds = float(row[1]) if row is not None else float("inf")
            # Thread ids start again when the server restarts: a connection opened
            # before the server's start is gone, and its id may now be another's.
            threads = {
                t: ms for t, ms in threads.items() if uptime_seconds + 1 >= (now_ms - ms) / 1000
            }
        killed: list[int] = []
        for thread_id in threads:
            try:
                await self.db.execute(f"KILL {int(thread_id)}")
                killed.append(thread_id)
            except pymysql.err.MySQLError as exc:
                if errno_of(exc) == ER_NO_SUCH_THREAD:
                    continue  # already gone
                if errno_of(exc) == ER_KILL_DENIED:
                    log.warning(
                        "janitor may not end thread %s of gate %s (another database user?);"
                        " its tokens wait for GATE_INFLIGHT_MAX_SECONDS",
                        thread_id,
                        owner,
                    )
                    return False
                raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + THREADS_GONE_WAIT_SECONDS
        while killed:
            rows = await store.live_threads(self.db, killed)
            killed = [int(r[0]) for r in rows]
            if killed:
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(0.02)
        log.warning(
            "gate %s is gone (lease lapsed, its %d recorded thread(s) ended)", owner, len(threads)
        )
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                lease = self.work_lease
                interval = self.settings.janitor_interval_seconds
                held = lease is None or await lease.held(interval)
                resolved = await self.run_once() if held else 0
            except Exception as exc:
                log.warning("janitor pass failed: %r", exc)
                resolved = 0
            if resolved < self.settings.janitor_batch_max:
                try:
                    await asyncio.wait_for(stop.wait(), self.settings.janitor_interval_seconds)
                except TimeoutError:
                    pass
        # Stopping: the next process to ask takes the work at once (gate/store/work_lease.py).
        if self.work_lease is not None:
            await self.work_lease.release()
