"""The room's estimates, once a second: each buyer's chance and the automatic rate.

    every gate process, once a second (the room loop, `Estimator.run_once`):
        HEALTH.take() ──> gate:room:health:<second> (503s, pool waits, commit p99)
        under the "room-estimate" work lease (one process at a time), per room:
            the admissions ring + avail + the room's hash ──> chance.measure/build
                ──> the room hash's "ch" (the table) and "chat" (when)
            "auto" rooms: + the last second's health ──> steering.decide
                ──> "arate", "aratio", "aoffset", "ayoung", "aat" (room_advance.lua
                    applies them), "aceil", "acut", "aprobe" (the next decision's
                    start), "areason", "adetail" (the console's room panel)
    every ticket read (`Tables.chance`): the table this process holds for the deal,
    fetched at most once a second per deal (HMGET "ch", "unl"), interpolated for
    the ticket's position: no Redis round trip of its own on a read.

What is not measured live: holds and their payments (the payments never reach
Redis), so the holds ring stays empty: the pay share is its prior and held units are
not counted as coming back (the chance errs low while holds are out), and nobody's
leaving is measured (no hazard). See docs/waiting-room.md, "Your chance".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import orjson
import redis.asyncio as aioredis

from gate.base.db_health import HEALTH
from gate.room import chance, steering
from gate.room.conversion import ADMISSION_SLOT_MS, HOLD_SLOT_MS, Ring
from gate.store.keys import ROOMS, deal_keys, room_health
from gate.store.resp import text
from gate.store.work_lease import WorkLease

log = logging.getLogger("gate.room")

# How long a process keeps a deal's table before fetching it again (a read between
# two estimates sees the same table anyway).
TABLE_SECONDS = 1.0
TABLES_MAX = 10_000
ESTIMATE_SECONDS = 1.0
# A health second's key lives this long (the decider reads the previous second's).
HEALTH_TTL_SECONDS = 10
# The hold a unit stays held at most before it lapses, for the pay stage's deadline
# (holds are not measured live: only the prior's deadline).
HOLD_SECONDS = 600.0
ROOMS_MAX = 10_000


class Tables:
    """Per process: each deal's chance table and `unlikely_below`, as the estimate
    loop last wrote them, kept TABLE_SECONDS."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        # deal -> (monotonic time fetched, table or None, unlikely_below)
        self._held: dict[int, tuple[float, chance.Table | None, float]] = {}
        self._fetching: dict[int, asyncio.Task[None]] = {}

    def fresh(self, deal_id: int) -> bool:
        held = self._held.get(deal_id)
        return held is not None and time.monotonic() - held[0] < TABLE_SECONDS

    async def ensure(self, deal_id: int) -> None:
        """Fetch the deal's table unless a fresh one is held (shared by concurrent
        callers); a failure keeps the old one (a chance is never worth a 503)."""
        if self.fresh(deal_id):
            return
        task = self._fetching.get(deal_id)
        if task is None:
            task = asyncio.ensure_future(self._fetch(deal_id))
            self._fetching[deal_id] = task
            task.add_done_callback(lambda _: self._fetching.pop(deal_id, None))
        await asyncio.shield(task)

    def kick(self, deal_id: int) -> None:
        """`ensure` in the background (a caller that cannot wait: the edge lane)."""
        if not self.fresh(deal_id) and deal_id not in self._fetching:
            task = asyncio.ensure_future(self._fetch(deal_id))
            self._fetching[deal_id] = task
            task.add_done_callback(lambda _: self._fetching.pop(deal_id, None))

    async def _fetch(self, deal_id: int) -> None:
        try:
            raw, unl = await self.redis.hmget(deal_keys(deal_id).room, ["ch", "unl"])
        except Exception as exc:
            log.info("deal %s: chance table not read: %r", deal_id, exc)
            return
        table, below = None, 0.0
        try:
            if raw:
                table = chance.Table.from_fields(raw)
            if unl:
                below = float(text(unl))
        except ValueError:
            # Not a table this version writes: none (the chance is null) until the
            # next estimate.
            log.info("deal %s: chance table unreadable", deal_id)
        if len(self._held) >= TABLES_MAX:
            self._held.clear()
        self._held[deal_id] = (time.monotonic(), table, below)

    def chance(
        self, deal_id: int, position: int, available: int
    ) -> tuple[dict[str, object] | None, bool]:
        """(the ticket's "chance", whether it reads "unlikely") for a waiting ticket at
        `position` while `available` units are (the read's own figure), from the table
        held (None without one). A table built on fewer units than are available now
        (units came back, stock was added since) is stale: it would say too little,
        down to "nothing left" while the room admits again; none until the next."""
        held = self._held.get(deal_id)
        if held is None:
            return None, False
        table = held[1]
        if table is not None and table.pool < available:
            return None, False
        found = chance.chance(table, position)
        below = held[2]
        unlikely = found is not None and below > 0 and cast(float, found["p"]) < below
        return found, unlikely


def _health(fields: dict[Any, Any]) -> steering.Health:
    overloaded = int(fields.get("o", 0))
    waits = int(fields.get("w", 0))
    p99s = [float(text(v)) for k, v in fields.items() if text(k).startswith("p:")]
    return steering.Health(overloaded, waits, max(p99s) if p99s else None)


def _steer(fields: dict[str, Any]) -> steering.Steer | None:
    if not fields.get("aceil"):
        return None
    return steering.Steer(
        float(fields["aceil"]), float(fields.get("acut") or "-inf"), fields.get("aprobe") == "1"
    )


class Estimator:
    def __init__(
        self, client: aioredis.Redis, lease: WorkLease, commit_p99_limit_ms: float
    ) -> None:
        self.redis = client
        self.lease = lease
        self.limit_ms = commit_p99_limit_ms
        self.owner = lease.owner

    async def publish_health(self) -> None:
        """This process's last second (503s, pool waits, commit p99) into the second's
        shared hash."""
        tally = HEALTH.take()
        key = room_health(int(time.time()))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hincrby(key, "o", tally.overloaded)
        pipe.hincrby(key, "w", tally.pool_waits)
        if tally.commit_p99_ms is not None:
            pipe.hset(key, f"p:{self.owner}", round(tally.commit_p99_ms, 1))
        pipe.expire(key, HEALTH_TTL_SECONDS)
        await pipe.execute()

    async def run_once(self) -> int:
        """Publish the health; under the lease, estimate every room: how many."""
        await self.publish_health()
        if not await self.lease.held(ESTIMATE_SECONDS):
            return 0
        members = await self.redis.smembers(ROOMS)
        raw = await self.redis.hgetall(room_health(int(time.time()) - 1))
        health = _health({text(k): v for k, v in raw.items()})
        done = 0
        for member in list(members)[:ROOMS_MAX]:
            try:
                await self.estimate(int(text(member)), health)
                done += 1
            except Exception as exc:
                log.warning("deal %s: room estimate failed: %r", text(member), exc)
        return done

    async def estimate(self, deal_id: int, health: steering.Health) -> None:
        keys = deal_keys(deal_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(keys.room_ring)
        pipe.hmget(keys.meta, ["avail", "end_ms", "max"])
        pipe.hmget(
            keys.room, ["on", "ttl_ms", "auto", "aps", "aceil", "acut", "aprobe", "admitted"]
        )
        pipe.hget(keys.room, "adm_prev")
        pipe.zcard(keys.room_queue)
        clock, ring_raw, meta, room, previous, waiting = await pipe.execute()
        on, ttl_ms, auto, aps, aceil, acut, aprobe, admitted = (
            text(v) if v is not None else None for v in room
        )
        if on != "1" or meta[0] is None or (not int(waiting) and auto != "1"):
            # Nothing to do: no room, its deal not loaded, or nobody waiting for a
            # chance in a room that sets no rate of its own.
            return
        now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
        avail = max(0, int(text(meta[0])))
        end_ms = int(text(meta[1])) if meta[1] else 0
        most = int(text(meta[2])) if meta[2] else 1
        ttl_s = int(ttl_ms or 120_000) / 1000
        sale_left = (end_ms - now_ms) / 1000 if end_ms > 0 else None
        ring = Ring.from_hash(ADMISSION_SLOT_MS, {text(k): text(v) for k, v in ring_raw.items()})
        sale = chance.measure(
            now_ms, avail, ring, Ring(HOLD_SLOT_MS), ttl_s, HOLD_SECONDS, most, sale_left
        )
        table = chance.build(sale)
        mapping: dict[str, str | int] = {**table.as_fields(), "chat": now_ms}
        if auto == "1":
            given = int(admitted or 0)
            last = int(text(previous)) if previous else given
            decision = steering.decide(
                now_ms=now_ms,
                available=avail,
                admissions=sale.admissions,
                stage=sale.admit,
                evidence=sale.seasoned,
                quantity=sale.quantity,
                admitted_last_second=max(0, given - last),
                health=health,
                max_admit_per_second=int(aps or 1),
                steer=_steer({"aceil": aceil, "acut": acut, "aprobe": aprobe}),
                deadline_s=ttl_s,
                commit_p99_limit_ms=self.limit_ms,
            )
            st = decision.steer
            mapping.update(
                {
                    "arate": decision.rate,
                    "aratio": repr(decision.ratio),
                    "aoffset": repr(decision.offset),
                    "ayoung": decision.young_from_ms,
                    "aat": now_ms,
                    "aceil": repr(st.ceiling),
                    "acut": repr(st.cut_at_s) if st.cut_at_s > float("-inf") else "",
                    "aprobe": "1" if st.probing else "0",
                    "areason": decision.reason,
                    "adetail": orjson.dumps(
                        {**decision.detail, "bound": decision.bound, **_health_view(health)}
                    ).decode(),
                    "adm_prev": given,
                }
            )
        await self.redis.hset(keys.room, mapping=cast(Any, mapping))


def _health_view(health: steering.Health) -> dict[str, float]:
    out = {"overloaded": float(health.overloaded), "pool_waits": float(health.pool_waits)}
    if health.commit_p99_ms is not None:
        out["commit_p99_ms"] = health.commit_p99_ms
    return out


async def run(estimator: Estimator, stop: asyncio.Event) -> None:
    """The estimate loop: `Estimator.run_once` every ESTIMATE_SECONDS; the lease is
    given back when it stops."""
    while not stop.is_set():
        try:
            await estimator.run_once()
        except Exception as exc:
            log.warning("room estimate pass failed: %r", exc)
        try:
            await asyncio.wait_for(stop.wait(), ESTIMATE_SECONDS)
        except TimeoutError:
            pass
    await estimator.lease.release()
