"""The Redis mirror of the database stock.

Redis only rejects early; the database is the truth. Every change Redis mirrors
leaves a marker in Redis for as long as Redis and the database may disagree about
it:
  * an admission token (lua/admit.lua): Redis took the units, the database may not
    have yet; confirmed or compensated once the transaction is decided;
  * an intent (lua/intend.lua): the database is changing stock (release, stock
    adjustment); applied to Redis or dropped once the transaction is decided.
Markers resolved recently are logged for a few seconds. With both, one consistent
database snapshot and one atomic script compute exactly what Redis should hold
(lua/sync_deal.lua, docs/redis-mirror.md): loading after a flush, rebuilding after
a layout change and repairing drift never guess.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gate.clock import epoch_ms
from gate.codes import SyncCode
from gate.db import Database
from gate.keys import ACTIVE_DEALS, DealKeys, deal_keys
from gate.redismode import redis_ms
from gate.scripts import ScriptRunner
from gate.settings import Settings

log = logging.getLogger("gate.mirror")

LOOKUP_CHUNK = 1000
BUYERS_CHUNK = 5000
INTENT_BATCH_MAX = 500
# The resolved log must outlive the longest sync pass by a margin.
SYNC_WINDOW_MS = 5_000
RESOLVED_RETENTION_MS = 15_000
# Reservations confirmed by one lua/confirm_many.lua call at most (its keys and
# arguments grow with it).
CONFIRM_BATCH_MAX = 256

# A confirmation waiting for its batch: idempotency key, token, fingerprint, the
# allocation the database committed, and the caller's future.
_Confirm = tuple[str, str, str, str, "asyncio.Future[Any]"]


def _deliver_confirms(chunk: list[_Confirm], sent: asyncio.Future[Any]) -> None:
    """Each caller of a confirmation batch gets its own code, or the batch's error."""
    exc = sent.exception() if not sent.cancelled() else asyncio.CancelledError()
    if exc is not None:
        for c in chunk:
            if not c[4].done():
                c[4].set_exception(exc)
        return
    result = sent.result()
    codes = result if isinstance(result, list) else [result]
    if len(codes) != len(chunk):
        wrong = RuntimeError(f"confirm answered {len(codes)} codes for {len(chunk)} tokens")
        for c in chunk:
            if not c[4].done():
                c[4].set_exception(wrong)
        return
    for c, code in zip(chunk, codes, strict=True):
        if not c[4].done():
            c[4].set_result(code)


@dataclass(frozen=True)
class Intent:
    """A change the database is about to commit and Redis will mirror afterwards."""

    id: str
    user_id: int  # 0: no per-user quota change
    units: int  # per-user quota delta (a release gives units back: negative)
    deltas: str  # bucket deltas "bucket:delta[,…]", signed

    def args(self) -> tuple[str, int, int, str]:
        return (self.id, self.user_id, self.units, self.deltas)


@dataclass(frozen=True)
class Marker:
    kind: str  # "T" admission token, "R" intent
    user_id: int
    quantity: int
    alloc: str
    created_ms: int
    idempotency_key: str
    fingerprint: str
    # The admitting process's lease id (gate/lease.py); "" for an intent, and for a
    # token admitted before tokens named their owner.
    owner: str = ""


def parse_marker(record: str) -> Marker:
    parts = record.split("|")
    if parts[0] == "T":
        user, qty, alloc, ms, key, fp = parts[1:7]
        owner = parts[7] if len(parts) > 7 else ""
        return Marker("T", int(user), int(qty), alloc, int(ms), key, fp, owner)
    _, user, units, deltas, ms = parts
    return Marker("R", int(user), int(units), deltas, int(ms), "", "")


class Mirror:
    def __init__(
        self, settings: Settings, db: Database, client: aioredis.Redis, runner: ScriptRunner
    ) -> None:
        self.settings = settings
        self.db = db
        self.redis = client
        self.runner = runner
        self._loading: dict[int, asyncio.Future[bool]] = {}
        # Confirmations asked in this event-loop turn, per deal (`confirm`).
        self._confirms: dict[int, tuple[DealKeys, list[_Confirm]]] = {}
        self._confirm_scheduled = False
        # Run before every sync pass of a deal with the deal and the pass's mode
        # ("load", "layout", "resync"): the waiting room (gate/room/) puts its
        # configuration in Redis before the deal's state.
        self.before_sync: list[Callable[[int, str], Awaitable[None]]] = []

    # -- reservations ----------------------------------------------------------------

    def admit(
        self,
        keys: DealKeys,
        user_id: int,
        quantity: int,
        fingerprint: str,
        token: str,
        start: int,
        idempotency_key: str,
        limiter_keys: tuple[str, str, str, str],
        limiter_args: Sequence[int],
        owner: str,
        admission: str = "",
        queue: tuple[tuple[str, str], tuple[int, int]] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue the admission script (see lua/admit.lua); the future resolves to its
        raw {code, detail}. Queued now, so calls made in the same event-loop turn
        (the global limiter, say) travel in the same pipeline. `queue`: a deal in
        queue mode, ((stream, status key), (queue cap, status TTL ms)): an admitted
        request is also queued by this same call."""
        in_progress_ms = int(self.settings.inflight_max_seconds * 1000) + 60_000
        keys_: tuple[str, ...] = (
            keys.meta,
            keys.buckets,
            keys.users,
            keys.idempotency(user_id, idempotency_key),
            keys.inflight,
            keys.inflight_times,
            *limiter_keys,
            keys.buyers,
            keys.room,
            keys.room_admitted,
            keys.room_expiry,
        )
        args: tuple[Any, ...] = (
            user_id,
            quantity,
            fingerprint,
            token,
            start,
            in_progress_ms,
            idempotency_key,
            *limiter_args,
            owner,
            admission,
        )
        if queue is not None:
            keys_ += queue[0]
            args += queue[1]
        return self.runner.call("admit", keys_, args)

    async def confirm(
        self, keys: DealKeys, user_id: int, idempotency_key: str, token: str, fp: str, alloc: str
    ) -> bool:
        """Retire a committed reservation's token (lua/confirm.lua). Confirmations of one
        deal asked in the same event-loop turn (a reservation group's items resume
        together) go to Redis as one lua/confirm_many.lua call: one script run and one
        reply for the lot, with each caller's own answer."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        pending = self._confirms.get(keys.deal_id)
        if pending is None:
            pending = self._confirms[keys.deal_id] = (keys, [])
            if not self._confirm_scheduled:
                self._confirm_scheduled = True
                loop.call_soon(self._flush_confirms)
        pending[1].append((keys.idempotency(user_id, idempotency_key), token, fp, alloc, fut))
        return int(await fut) == 1

    def _flush_confirms(self) -> None:
        self._confirm_scheduled = False
        batches, self._confirms = self._confirms, {}
        ttl = self.settings.idempotency_ttl_seconds
        for keys, items in batches.values():
            for i in range(0, len(items), CONFIRM_BATCH_MAX):
                chunk = items[i : i + CONFIRM_BATCH_MAX]
                if len(chunk) == 1:
                    key, token, fp, alloc, _ = chunk[0]
                    sent = self.runner.call(
                        "confirm",
                        (
                            keys.meta,
                            keys.buckets,
                            keys.inflight,
                            keys.inflight_times,
                            keys.resolved,
                            key,
                        ),
                        (token, fp, ttl, alloc, RESOLVED_RETENTION_MS),
                    )
                else:
                    args: list[Any] = [ttl, RESOLVED_RETENTION_MS]
                    for _, token, fp, alloc, _ in chunk:
                        args += (token, fp, alloc)
                    sent = self.runner.call(
                        "confirm_many",
                        (
                            keys.meta,
                            keys.buckets,
                            keys.inflight,
                            keys.inflight_times,
                            keys.resolved,
                            *(c[0] for c in chunk),
                        ),
                        args,
                    )
                sent.add_done_callback(functools.partial(_deliver_confirms, chunk))

    def confirm_call(
        self, keys: DealKeys, user_id: int, idempotency_key: str, token: str, fp: str, alloc: str
    ) -> asyncio.Future[Any]:
        """`confirm`'s script call, queued now (a batch's calls share a pipeline
        without a task each); the future resolves to its raw reply."""
        return self.runner.call(
            "confirm",
            (
                keys.meta,
                keys.buckets,
                keys.inflight,
                keys.inflight_times,
                keys.resolved,
                keys.idempotency(user_id, idempotency_key),
            ),
            (token, fp, self.settings.idempotency_ttl_seconds, alloc, RESOLVED_RETENTION_MS),
        )

    async def compensate(
        self, keys: DealKeys, user_id: int, idempotency_key: str, token: str
    ) -> bool:
        result = await self.runner.call(
            "compensate",
            (
                keys.meta,
                keys.buckets,
                keys.users,
                keys.idempotency(user_id, idempotency_key),
                keys.inflight,
                keys.inflight_times,
            ),
            (token,),
        )
        return int(result) == 1

    # -- releases and adjustments ------------------------------------------------------

    async def intend(self, deal_id: int, intents: Sequence[Intent]) -> int:
        """Record intents before their transaction commits."""
        keys = deal_keys(deal_id)
        recorded = 0
        for i in range(0, len(intents), INTENT_BATCH_MAX):
            chunk = intents[i : i + INTENT_BATCH_MAX]
            args: list[Any] = [len(chunk)]
            for intent in chunk:
                args.extend(intent.args())
            recorded += int(
                await self.runner.call(
                    "intend", (keys.meta, keys.inflight, keys.inflight_times), args
                )
            )
        return recorded

    async def apply(self, deal_id: int, outcomes: Sequence[tuple[str, bool]]) -> int:
        """Resolve intents after their transaction: apply the committed, drop the rest."""
        keys = deal_keys(deal_id)
        applied = 0
        for i in range(0, len(outcomes), INTENT_BATCH_MAX):
            chunk = outcomes[i : i + INTENT_BATCH_MAX]
            args: list[Any] = [RESOLVED_RETENTION_MS, len(chunk)]
            for intent_id, committed in chunk:
                args.extend((intent_id, "1" if committed else "0"))
            applied += int(await self.runner.call("apply", keys.state, args))
        return applied

    # -- loading, rebuilding, resync ----------------------------------------------------

    async def load(self, deal_id: int) -> bool:
        """Build a deal's state from the database when Redis lacks it. False: no such deal.

        Concurrent callers in this process share one load.
        """
        running = self._loading.get(deal_id)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._loading[deal_id] = fut
        try:
            found = await self._sync(deal_id, "load") is not None
            if found:
                await self.rebuild_buyers(deal_id)
            fut.set_result(found)
            return found
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: there may be no other waiter
            raise
        finally:
            del self._loading[deal_id]

    async def rebuild(self, deal_id: int) -> bool:
        """Rebuild a deal's buckets now (after creation or rebucketing)."""
        return await self._sync(deal_id, "layout") is not None

    async def rebuild_buyers(self, deal_id: int) -> None:
        """Refill the set of users ever admitted to a deal from its orders, then mark
        it complete: only then may a gate answer "sold out" from its near-cache.

        Admissions during the rebuild add themselves (admit.lua), and every order
        committed before the read below is in it, so the set is complete."""
        keys = deal_keys(deal_id)
        if await self.redis.hget(keys.meta, "buyers_ok"):
            return
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("SELECT DISTINCT user_id FROM orders WHERE deal_id = %s", (deal_id,))
            while rows := await cur.fetchmany(BUYERS_CHUNK):
                await self.redis.sadd(keys.buyers, *(int(r[0]) for r in rows))
        await self.redis.hset(keys.meta, "buyers_ok", 1)

    async def resync(self, deal_id: int) -> tuple[SyncCode, str] | None:
        """Repair drift exactly. None: the deal no longer exists in the database."""
        result = await self._sync(deal_id, "resync")
        if result is not None and result[0] == SyncCode.NOT_LOADED:
            await self.load(deal_id)
        return result

    async def _sync(self, deal_id: int, mode: str) -> tuple[SyncCode, str] | None:
        keys = deal_keys(deal_id)
        for hook in self.before_sync:
            await hook(deal_id, mode)
        # From the deal's node: the resolved markers' scores come from its clock.
        t0 = await redis_ms(self.redis, keys.meta)
        async with self.db.snapshot() as cur:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hkeys(keys.inflight)
            pipe.zrangebyscore(keys.resolved, t0, "+inf")
            marker_ids, done = await pipe.execute()
            ids = sorted({str(m) for m in marker_ids} | {str(e).split("|", 1)[0] for e in done})
            await cur.execute(
                "SELECT bucket_count, layout_epoch, starts_at, ends_at, max_per_order,"
                " per_user_limit FROM deals WHERE id = %s",
                (deal_id,),
            )
            deal = await cur.fetchone()
            if deal is None:
                return None
            nb, epoch = int(deal[0]), int(deal[1])
            await cur.execute(
                "SELECT bucket, available FROM deal_buckets WHERE deal_id = %s AND epoch = %s",
                (deal_id, epoch),
            )
            available = [0] * nb
            for bucket, avail in await cur.fetchall():
                available[int(bucket)] = int(avail)
            committed = await _committed(cur, ids)
            users: list[tuple[int, int]] = []
            if mode == "load" and deal[5] is not None:
                await cur.execute(
                    "SELECT user_id, units FROM user_quota WHERE deal_id = %s AND units > 0",
                    (deal_id,),
                )
                users = [(int(u), int(n)) for u, n in await cur.fetchall()]
        args: list[Any] = [
            mode,
            t0,
            SYNC_WINDOW_MS,
            nb,
            epoch_ms(deal[2]),
            epoch_ms(deal[3]),
            int(deal[4]),
            int(deal[5] or 0),
            epoch,
            len(committed),
            *committed,
            *available,
            len(users),
        ]
        for user, units in users:
            args.extend((user, units))
        code, detail = await self.runner.call("sync_deal", keys.state, args)
        result = SyncCode(int(code)), str(detail)
        if result[0] == SyncCode.STALE:
            log.warning("deal %s: %s pass took too long; nothing changed", deal_id, mode)
        elif result[0] == SyncCode.APPLIED:
            log.warning("deal %s: repaired Redis drift %s", deal_id, result[1])
        await self.redis.sadd(ACTIVE_DEALS, deal_id)
        return result

    async def forget(self, deal_id: int) -> None:
        keys = deal_keys(deal_id)
        await self.redis.delete(*keys.state, keys.buyers)
        await self.redis.srem(ACTIVE_DEALS, deal_id)

    async def available(self, deal_id: int) -> int | None:
        """Units Redis believes are left, loading the deal if absent. None: no such deal."""
        keys = deal_keys(deal_id)
        value = await self.redis.hget(keys.meta, "avail")
        if value is None:
            if not await self.load(deal_id):
                return None
            value = await self.redis.hget(keys.meta, "avail")
        return max(0, int(value or 0))


async def _committed(cur: Any, ids: Sequence[str]) -> list[str]:
    """Which of these operations the snapshot holds: "order id=allocation" for
    reservations (the order exists), "intent id" for intents (ledger rows carry it)."""
    found: list[str] = []
    for i in range(0, len(ids), LOOKUP_CHUNK):
        chunk = tuple(ids[i : i + LOOKUP_CHUNK])
        marks = ",".join(["%s"] * len(chunk))
        await cur.execute(f"SELECT id, alloc FROM orders WHERE id IN ({marks})", chunk)
        orders = {str(r[0]): str(r[1]) for r in await cur.fetchall()}
        found.extend(f"{oid}={alloc}" for oid, alloc in orders.items())
        rest = tuple(x for x in chunk if x not in orders)
        if rest:
            marks = ",".join(["%s"] * len(rest))
            await cur.execute(
                f"SELECT DISTINCT op_id FROM inventory_ledger WHERE op_id IN ({marks})", rest
            )
            found.extend(str(r[0]) for r in await cur.fetchall())
    return found
