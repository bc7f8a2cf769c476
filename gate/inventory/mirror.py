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

A deal of P > 1 partitions (docs/scale-out.md, "Deal partitions") has P such states,
one per hash tag (gate/store/keys.py partition_keys), each mirroring the buckets it owns
(b MOD P = k) exactly as above: the markers of a partition only ever name its own
buckets, so every argument of docs/redis-mirror.md holds per partition. An intent
that spans partitions (a stock adjustment) is recorded in each partition it touches,
under the same id with that partition's deltas; the ledger (op_id) decides all of
them alike.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gate.base.clock import epoch_ms
from gate.base.codes import SyncCode
from gate.base.settings import Settings
from gate.base.singleflight import SingleFlight
from gate.store.batcher import TurnBatcher
from gate.store.db import Database
from gate.store.keys import ACTIVE_DEALS, DealKeys, deal_keys, partition_keys
from gate.store.redis_mode import redis_ms
from gate.store.scripts import ScriptRunner

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
# Deals whose partition count a process remembers (a deal's P never changes).
PARTS_CACHE_MAX = 100_000

# A confirmation waiting for its batch: the deal's keys, the idempotency key, token,
# fingerprint, the allocation the database committed, and the caller's future.
_Confirm = tuple[DealKeys, str, str, str, str, "asyncio.Future[Any]"]


def _deliver_confirms(chunk: list[_Confirm], sent: asyncio.Future[Any]) -> None:
    """Each caller of a confirmation batch gets its own code, or the batch's error."""
    exc = sent.exception() if not sent.cancelled() else asyncio.CancelledError()
    if exc is not None:
        for c in chunk:
            if not c[5].done():
                c[5].set_exception(exc)
        return
    result = sent.result()
    codes = result if isinstance(result, list) else [result]
    if len(codes) != len(chunk):
        wrong = RuntimeError(f"confirm answered {len(codes)} codes for {len(chunk)} tokens")
        for c in chunk:
            if not c[5].done():
                c[5].set_exception(wrong)
        return
    for c, code in zip(chunk, codes, strict=True):
        if not c[5].done():
            c[5].set_result(code)


def _confirm_keys(keys: DealKeys, idempotency: list[str]) -> tuple[str, ...]:
    """lua/confirm.lua's and lua/confirm_many.lua's KEYS: the deal's state, then each
    reservation's idempotency record."""
    return (
        keys.meta,
        keys.buckets,
        keys.inflight,
        keys.inflight_times,
        keys.resolved,
        *idempotency,
    )


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
    # The admitting process's lease id (gate/store/process_lease.py); "" for an intent, and for a
    # token admitted before tokens named their owner.
    owner: str = ""


def split_intent(intent: Intent, nb: int, partitions: int) -> dict[int, Intent]:
    """An intent's part per partition (bucket b belongs to (b MOD nb) MOD P), under
    the same id. The buyer's units go with the bucket deltas: a partition counts the
    units of the orders whose buckets it owns (an order's buckets are all in one
    partition; a late re-take may span several, its units then split as its deltas)."""
    per: dict[int, list[str]] = {}
    sums: dict[int, int] = {}
    for part in intent.deltas.split(","):
        if not part:
            continue
        b, d = part.split(":")
        k = (int(b) % nb) % partitions
        per.setdefault(k, []).append(part)
        sums[k] = sums.get(k, 0) + int(d)
    if not per:
        return {0: intent}
    total = sum(sums.values())
    out: dict[int, Intent] = {}
    first = next(iter(per))
    for k, parts in per.items():
        if intent.units == 0 or intent.user_id == 0:
            units = 0
        elif abs(total) == abs(intent.units):
            units = abs(sums[k]) * (1 if intent.units > 0 else -1)
        else:
            units = intent.units if k == first else 0
        out[k] = Intent(intent.id, intent.user_id, units, ",".join(parts))
    return out


def parse_marker(record: str) -> Marker:
    parts = record.split("|")
    if parts[0] == "T":
        user, qty, alloc, ms, key, fp = parts[1:7]
        owner = parts[7] if len(parts) > 7 else ""
        return Marker("T", int(user), int(qty), alloc, int(ms), key, fp, owner)
    _, user, units, deltas, ms = parts
    return Marker("R", int(user), int(units), deltas, int(ms), "", "")


# A queue-mode admission's extra keys and arguments (lua/admit.lua KEYS[15..17],
# ARGV[18..20]; gate/queuemode/service.py `QueueService.admission`).
QueueArgs = tuple[tuple[str, ...], tuple[Any, ...]]


class Mirror:
    def __init__(
        self, settings: Settings, db: Database, client: aioredis.Redis, runner: ScriptRunner
    ) -> None:
        self.settings = settings
        self.db = db
        self.redis = client
        self.runner = runner
        self._loading: SingleFlight[int, bool] = SingleFlight()
        self._partitions: SingleFlight[int, int] = SingleFlight()
        # deal -> its partition count P (fixed at creation): read from the database
        # once per process (`partitions`), or from partition 0's meta on the hot path
        # (`partitions_hint`). Absent: not known yet.
        self.parts: dict[int, int] = {}
        self._nbs: dict[int, int] = {}  # bucket count of partitioned deals (fixed)
        # Confirmations asked in this event-loop turn, per deal partition's hash tag
        # (`confirm`), CONFIRM_BATCH_MAX a script call at most.
        self._confirms: TurnBatcher[str, _Confirm] = TurnBatcher(
            self._write_confirms, CONFIRM_BATCH_MAX
        )
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
        queue: QueueArgs | None = None,
    ) -> asyncio.Future[Any]:
        """Queue the admission script (see lua/admit.lua); the future resolves to its
        raw {code, detail}. Queued now, so calls made in the same event-loop turn
        (the global limiter, say) travel in the same pipeline. `queue`: a deal in
        queue mode, ((stream, status key[, order index]), (queue cap, status TTL ms[,
        "deal|user"])): an admitted request is also queued by this same call."""
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
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Per hash tag: a partitioned deal's partitions are separate states (slots).
        self._confirms.add(
            keys.tag, (keys, keys.idempotency(user_id, idempotency_key), token, fp, alloc, fut)
        )
        return int(await fut) == 1

    def _write_confirms(self, groups: list[tuple[str, list[_Confirm]]]) -> None:
        for _, chunk in groups:
            keys = chunk[0][0]
            if len(chunk) == 1:
                _, key, token, fp, alloc, _ = chunk[0]
                sent = self._confirm_one(keys, key, token, fp, alloc)
            else:
                args: list[Any] = [self.settings.idempotency_ttl_seconds, RESOLVED_RETENTION_MS]
                for _, _, token, fp, alloc, _ in chunk:
                    args += (token, fp, alloc)
                sent = self.runner.call(
                    "confirm_many", _confirm_keys(keys, [c[1] for c in chunk]), args
                )
            sent.add_done_callback(functools.partial(_deliver_confirms, chunk))

    def confirm_call(
        self, keys: DealKeys, user_id: int, idempotency_key: str, token: str, fp: str, alloc: str
    ) -> asyncio.Future[Any]:
        """`confirm`'s script call, queued now (a batch's calls share a pipeline
        without a task each); the future resolves to its raw reply."""
        return self._confirm_one(keys, keys.idempotency(user_id, idempotency_key), token, fp, alloc)

    def _confirm_one(
        self, keys: DealKeys, idempotency: str, token: str, fp: str, alloc: str
    ) -> asyncio.Future[Any]:
        ttl = self.settings.idempotency_ttl_seconds
        return self.runner.call(
            "confirm",
            _confirm_keys(keys, [idempotency]),
            (token, fp, ttl, alloc, RESOLVED_RETENTION_MS),
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
        """Record intents before their transaction commits (in each partition an
        intent touches, for a partitioned deal)."""
        parts = await self._partitions_of_loaded(deal_id)
        if parts == 1:
            return await self._intend(deal_keys(deal_id), intents)
        nb = await self._bucket_count(deal_id)
        per: dict[int, list[Intent]] = {}
        for intent in intents:
            for k, piece in split_intent(intent, nb, parts).items():
                per.setdefault(k, []).append(piece)
        recorded = 0
        for k, pieces in per.items():
            recorded = max(recorded, await self._intend(partition_keys(deal_id, k), pieces))
        return recorded

    async def _intend(self, keys: DealKeys, intents: Sequence[Intent]) -> int:
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
        """Resolve intents after their transaction: apply the committed, drop the rest.
        A partitioned deal: in every partition (each acts only on the markers it holds);
        the count is then at most one per intent."""
        parts = await self._partitions_of_loaded(deal_id)
        if parts == 1:
            return await self.apply_keys(deal_keys(deal_id), outcomes)
        applied = 0
        for k in range(parts):
            applied += await self.apply_keys(partition_keys(deal_id, k), outcomes)
        return min(applied, len(outcomes))

    async def apply_keys(self, keys: DealKeys, outcomes: Sequence[tuple[str, bool]]) -> int:
        """`apply` on one partition's state."""
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

        Concurrent callers in this process share one load (gate/base/singleflight.py).
        """
        return await self._loading.run(deal_id, lambda: self._load(deal_id))

    async def _load(self, deal_id: int) -> bool:
        found = await self._sync(deal_id, "load") is not None
        if found:
            await self.rebuild_buyers(deal_id)
        return found

    async def rebuild(self, deal_id: int) -> bool:
        """Rebuild a deal's buckets now (after creation or rebucketing)."""
        return await self._sync(deal_id, "layout") is not None

    async def rebuild_buyers(self, deal_id: int) -> None:
        """Refill the set of users ever admitted to a deal from its orders, then mark
        it complete: only then may a gate answer "sold out" from its near-cache.

        Admissions during the rebuild add themselves (admit.lua), and every order
        committed before the read below is in it, so the set is complete. A
        partitioned deal: every partition's set gets all of the deal's buyers (a
        superset of those it admitted: at worst a database look-up more, never a
        near-cache answer to a buyer of the deal)."""
        parts = await self.partitions(deal_id)
        todo = []
        for k in range(parts):
            keys = partition_keys(deal_id, k)
            if not await self.redis.hget(keys.meta, "buyers_ok"):
                todo.append(keys)
        if not todo:
            return
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("SELECT DISTINCT user_id FROM orders WHERE deal_id = %s", (deal_id,))
            while rows := await cur.fetchmany(BUYERS_CHUNK):
                users = [int(r[0]) for r in rows]
                for keys in todo:
                    await self.redis.sadd(keys.buyers, *users)
        for keys in todo:
            await self.redis.hset(keys.meta, "buyers_ok", 1)

    async def resync(self, deal_id: int) -> tuple[SyncCode, str] | None:
        """Repair drift exactly. None: the deal no longer exists in the database."""
        result = await self._sync(deal_id, "resync")
        if result is not None and result[0] == SyncCode.NOT_LOADED:
            await self.load(deal_id)
        return result

    # -- partitions ----------------------------------------------------------------------

    async def partitions(self, deal_id: int) -> int:
        """The deal's partition count P (1 for a deal that does not exist)."""
        parts = self.parts.get(deal_id)
        if parts is not None:
            return parts
        # Concurrent first asks of one deal share the read (gate/base/singleflight.py).
        return await self._partitions.run(deal_id, lambda: self._read_partitions(deal_id))

    async def _read_partitions(self, deal_id: int) -> int:
        row = await self.db.fetchone(
            "SELECT partitions, bucket_count FROM deals WHERE id = %s", (deal_id,)
        )
        if row is None:
            return 1
        return self._learn(deal_id, int(row[0]), int(row[1]))

    def _learn(self, deal_id: int, parts: int, nb: int) -> int:
        if len(self.parts) >= PARTS_CACHE_MAX:
            self.parts.clear()
        self.parts[deal_id] = parts
        if parts > 1:
            # A partitioned deal is never rebucketed (gate/inventory/deals.py): nb is fixed too.
            if len(self._nbs) >= PARTS_CACHE_MAX:
                self._nbs.clear()
            self._nbs[deal_id] = nb
        return parts

    async def partitions_hint(self, deal_id: int) -> int:
        """P for the hot path: partition 0's meta says it ("pp") once the deal is
        loaded. A deal not loaded yet counts as 1 (not remembered): its admission
        answers NOT_LOADED, and the load learns P from the database."""
        nb, pp = await self.runner.call("deal_parts", (deal_keys(deal_id).meta,), ())
        if nb is None:
            return 1
        return self._learn(deal_id, int(pp or 1), int(nb))

    async def _partitions_of_loaded(self, deal_id: int) -> int:
        """P for a caller that may hold a database transaction (a release records its
        intents before it commits): from memory or partition 0's meta, the database
        only when Redis does not have the deal (no second connection taken while the
        pool may be exhausted by such callers, except for a deal Redis lacks)."""
        parts = self.parts.get(deal_id)
        if parts is not None:
            return parts
        nb, pp = await self.redis.hmget(deal_keys(deal_id).meta, ["nb", "pp"])
        if nb is not None:
            return self._learn(deal_id, int(pp or 1), int(nb))
        return await self.partitions(deal_id)

    async def _bucket_count(self, deal_id: int) -> int:
        nb = self._nbs.get(deal_id)
        if nb is None:
            row = await self.db.fetchone("SELECT bucket_count FROM deals WHERE id = %s", (deal_id,))
            nb = int(row[0]) if row else 1
        return nb

    def bucket_count_of(self, deal_id: int) -> int | None:
        """The bucket count of a partitioned deal this process knows (None: unknown)."""
        return self._nbs.get(deal_id)

    def keys_of(self, deal_id: int, parts: int) -> list[DealKeys]:
        return [partition_keys(deal_id, k) for k in range(parts)]

    async def _sync(self, deal_id: int, mode: str) -> tuple[SyncCode, str] | None:
        for hook in self.before_sync:
            await hook(deal_id, mode)
        parts = await self.partitions(deal_id)
        pkeys = self.keys_of(deal_id, parts)
        # From each partition's node: the resolved markers' scores come from its clock.
        t0s = [await redis_ms(self.redis, keys.meta) for keys in pkeys]
        async with self.db.snapshot() as cur:
            ids_set: set[str] = set()
            for keys, t0 in zip(pkeys, t0s, strict=True):
                pipe = self.redis.pipeline(transaction=False)
                pipe.hkeys(keys.inflight)
                pipe.zrangebyscore(keys.resolved, t0, "+inf")
                marker_ids, done = await pipe.execute()
                ids_set |= {str(m) for m in marker_ids} | {str(e).split("|", 1)[0] for e in done}
            ids = sorted(ids_set)
            await cur.execute(
                "SELECT bucket_count, layout_epoch, starts_at, ends_at, max_per_order,"
                " per_user_limit, paused_at IS NOT NULL FROM deals WHERE id = %s",
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
            users: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
            if mode == "load" and deal[5] is not None:
                if parts == 1:
                    await cur.execute(
                        "SELECT user_id, units FROM user_quota WHERE deal_id = %s AND units > 0",
                        (deal_id,),
                    )
                    users[0] = [(int(u), int(n)) for u, n in await cur.fetchall()]
                else:
                    users = await _partition_quota(cur, deal_id, nb, parts)
        results: list[tuple[SyncCode, str]] = []
        for k, (keys, t0) in enumerate(zip(pkeys, t0s, strict=True)):
            mine = (
                available
                if parts == 1
                else [a if b % parts == k else 0 for b, a in enumerate(available)]
            )
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
                # The pause, as of this snapshot (gate/inventory/pause.py).
                "1" if deal[6] else "0",
                len(committed),
                *committed,
                *mine,
                len(users[k]),
            ]
            for user, units in users[k]:
                args.extend((user, units))
            if parts > 1:
                args.append(parts)
            code, detail = await self.runner.call("sync_deal", keys.state, args)
            result = SyncCode(int(code)), str(detail)
            if result[0] == SyncCode.STALE:
                log.warning("deal %s: %s pass took too long; nothing changed", keys.tag, mode)
            elif result[0] == SyncCode.APPLIED:
                log.warning("deal %s: repaired Redis drift %s", keys.tag, result[1])
            results.append(result)
        await self.redis.sadd(ACTIVE_DEALS, deal_id)
        if parts == 1:
            return results[0]
        return _combined(results)

    async def forget(self, deal_id: int) -> None:
        for keys in self.keys_of(deal_id, await self.partitions(deal_id)):
            await self.redis.delete(*keys.state, keys.buyers)
        await self.redis.srem(ACTIVE_DEALS, deal_id)

    async def available(self, deal_id: int) -> int | None:
        """Units Redis believes are left, loading the deal if absent. None: no such deal."""
        parts = await self.partitions(deal_id)
        values = await self._avails(deal_id, parts)
        if any(v is None for v in values):
            if not await self.load(deal_id):
                return None
            values = await self._avails(deal_id, parts)
        return sum(max(0, int(v or 0)) for v in values)

    async def _avails(self, deal_id: int, parts: int) -> list[Any]:
        """Each partition's `avail` (None: not loaded), one script call each, sent in
        the same write."""
        calls = [
            self.runner.call("deal_avail", (k.meta,), ()) for k in self.keys_of(deal_id, parts)
        ]
        return list(await asyncio.gather(*calls))


def _combined(results: list[tuple[SyncCode, str]]) -> tuple[SyncCode, str]:
    """One answer for a partitioned deal's passes: a stale or absent partition first,
    then the repairs (each prefixed by its partition), else the first answer."""
    for code in (SyncCode.STALE, SyncCode.NOT_LOADED):
        if any(r[0] == code for r in results):
            return code, ""
    repairs = [f"p{k}[{r[1]}]" for k, r in enumerate(results) if r[0] == SyncCode.APPLIED]
    if repairs:
        return SyncCode.APPLIED, " ".join(repairs)
    built = [r for r in results if r[0] != SyncCode.EXISTED] if results else []
    return built[0] if built else results[0]


async def _partition_quota(
    cur: Any, deal_id: int, nb: int, parts: int
) -> list[list[tuple[int, int]]]:
    """Per partition, the units each buyer holds or bought there (the orders' buckets
    decide: partition (b MOD nb) MOD P), from the snapshot."""
    await cur.execute(
        "SELECT user_id, alloc FROM orders WHERE deal_id = %s"
        " AND status IN ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')",
        (deal_id,),
    )
    per: list[dict[int, int]] = [{} for _ in range(parts)]
    while rows := await cur.fetchmany(BUYERS_CHUNK):
        for user, alloc in rows:
            for part in str(alloc).split(","):
                if ":" not in part:
                    continue
                b, q = part.split(":")
                k = (int(b) % nb) % parts
                per[k][int(user)] = per[k].get(int(user), 0) + int(q)
    return [[(u, n) for u, n in d.items() if n > 0] for d in per]


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
