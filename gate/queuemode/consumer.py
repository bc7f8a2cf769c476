"""Queue mode's consumers: commit each deal's queued requests in groups, exactly once.

Every `gate serve` process runs one consumer (`run()`), a member named per process
of the group "gate" of each deal's stream {d:ID}:q. One pass (`run_once()`), per
deal in gate:q:deals (and, every UNNAMED_WALK_SECONDS, per deal in queue mode that
set does not name: it may have lost it), takes at most GATE_QUEUE_BATCH_MAX entries:

    its own unacknowledged entries whose retry backoff has passed
    + entries another consumer left unacknowledged for GATE_QUEUE_CLAIM_IDLE_SECONDS
      (it died: XAUTOCLAIM; the claim idle exceeds any commit's deadline)
    + new entries (XREADGROUP >)
        ──> queue_take.lua, one call for the batch: "Q"/"C" -> "C" (attempt n;
            cancel now refused)
            "X|…" (rejected or cancelled) ──> order.rejected outbox row (once)
                ──> compensate (acts once) ──> ack
        ──> a retried or claimed entry whose order the database already holds
            (an earlier attempt committed, the answer was lost) ──> confirm ──> ack
        ──> CALL gate_reserve_group for the rest (one transaction, gate/reserve/groups.py's
            procedure); an item it cannot take whole goes through gate_reserve alone
            ├─ committed ──> confirm (token leaves the in-flight hash) ──> ack
            ├─ refused (SOLD_OUT, LIMIT_EXCEEDED…) ──> status "X|CODE" ──> compensate
            │   ──> ack
            └─ failed (database down, connection lost: its server thread is ended
               first) ──> stays unacknowledged, retried after a backoff; at the
               GATE_QUEUE_ATTEMPTS_MAX-th failure ──> queue_dead_letters row,
               status "X|DEAD_LETTER", compensate ──> ack

A rejection (a refusal, a buyer's cancel while queued, a dead letter) is also written
to the outbox as `order.rejected` (event id: the order id, INSERT IGNORE), after its
final status is fenced and before its entry is acknowledged, so the event stream and
the shop's webhooks learn of it durably; a consumer killed in between leaves the
entry to the next, which writes it.

Exactly once: an order id is the primary key of `orders`, so a second commit of one
request can only fail (DUPLICATE, then the order is found and confirmed); units go
back only through compensate.lua, which acts only for the call that removes the
token; an entry is acknowledged (and deleted) only after its outcome is in Redis, so
a consumer killed anywhere leaves it to another that redoes the same steps.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
import pymysql
from redis.exceptions import ResponseError

from gate.base.backoff import Backoff
from gate.base.codes import DbCode
from gate.base.errors import from_db
from gate.base.metrics import METRICS
from gate.queuemode import store
from gate.reserve.groups import reservation_call
from gate.store.db import DbUnavailable, OutcomeUnknown
from gate.store.keys import QUEUE_DEALS, deal_keys, owner_keys, queue_keys
from gate.store.resp import text

if TYPE_CHECKING:
    from gate.queuemode.service import QueueService, QueueSettings
    from gate.runtime import Gate

log = logging.getLogger("gate.queue.consumer")

GROUP = "gate"
DEALS_PER_PASS_MAX = 1000
SINGLES_CONCURRENCY = 4
LAST_ERROR_MAX_CHARS = 500
RETRY_BACKOFF_MAX_SECONDS = 30.0
TRACKED_MAX = 100_000
# The pause after a pass that settled nothing: doubled while the queues stay empty, up
# to the maximum, and back to the minimum as soon as this process enqueues (or a pass
# settles something). An idle gate then asks Redis twice a second, not fifty times,
# and a request queued here is picked up at once; one queued by another process waits
# at most IDLE_MAX_SECONDS for this consumer (its own process's consumer is woken).
# How often a deal's own pending entries are re-read (no retry waiting) and its dead
# consumers looked for, per process.
RECHECK_SECONDS = 0.5
CONSUMERS_SEEN_MAX = 1000
# A consumer idle this long with nothing pending, whose lease is gone, is forgotten.
FORGET_IDLE_MS = 600_000
IDLE_MIN_SECONDS = 0.02
IDLE_MAX_SECONDS = 0.5
# How often a drain loop also walks the deals in queue mode that gate:q:deals does not
# name (`_drain_unnamed`): an idle one costs a Redis call or two per walk.
UNNAMED_WALK_SECONDS = 2.0

COMMITTED = METRICS.counter(
    "gate_queue_committed_total", "Queued reservations committed (PENDING_PAYMENT).", ["deal"]
)
REJECTED = METRICS.counter(
    "gate_queue_rejected_total",
    "Queued reservations rejected (reason: the problem code, CANCELLED, DEAD_LETTER).",
    ["deal", "reason"],
)
RETRIES = METRICS.counter(
    "gate_queue_retries_total",
    "Commit attempts of queued reservations that failed and wait for a retry.",
    ["deal"],
)
DEAD_LETTERS = METRICS.counter(
    "gate_queue_dead_letters_total",
    "Queued reservations moved to queue_dead_letters after GATE_QUEUE_ATTEMPTS_MAX failures.",
    ["deal"],
)
DEPTH = METRICS.gauge(
    "gate_queue_depth", "Requests in the deal's queue (waiting or being committed).", ["deal"]
)
OLDEST_AGE = METRICS.gauge(
    "gate_queue_oldest_age_seconds", "Age of the oldest request in the deal's queue.", ["deal"]
)
COMMIT_LAG = METRICS.histogram(
    "gate_queue_commit_lag_seconds",
    "From enqueue (202) to committed (PENDING_PAYMENT), per queued reservation.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


@dataclass
class Entry:
    entry_id: str
    token: str
    user_id: int
    quantity: int
    alloc: str
    idempotency_key: str
    fingerprint: str
    enqueued_ms: int
    attempts: int = 0

    @classmethod
    def parse(cls, entry_id: Any, fields: dict[Any, Any]) -> Entry | None:
        # The client decodes replies (str); bytes only from another client's reply.
        f = (
            fields
            if isinstance(next(iter(fields), ""), str)
            else {text(k): text(v) for k, v in fields.items()}
        )
        try:
            return cls(
                text(entry_id),
                f["token"],
                int(f["user"]),
                int(f["qty"]),
                f["alloc"],
                f["key"],
                f["fp"],
                int(f["ms"]),
            )
        except (KeyError, ValueError):
            return None


def _reason(code: DbCode) -> str:
    """The REJECTED order's reason: the problem code the sync path would answer."""
    if code in (
        DbCode.SOLD_OUT,
        DbCode.LIMIT_EXCEEDED,
        DbCode.NOT_FOUND,
        DbCode.NOT_ACTIVE,
        DbCode.BAD_QUANTITY,
    ):
        return from_db(code).code
    return code.name


def _owner_of(consumer: str) -> str | None:
    """The lease id a consumer is named by ("OWNER-SLOT"); None for another name."""
    owner, _, slot = consumer.rpartition("-")
    return owner if owner and slot.isdigit() else None


class QueueConsumer:
    def __init__(self, gate: Gate, settings: QueueSettings, service: QueueService) -> None:
        self.gate = gate
        self.settings = settings
        self.service = service
        self.drains = settings.drains
        self.claim_idle_ms = int(settings.claim_idle_seconds * 1000)
        self.timeout_seconds = gate.settings.reservation_db_timeout_seconds
        self._groups: set[int] = set()
        # Entry id -> loop time before which its retry waits (this process's own).
        self._next_try: dict[str, float] = {}
        # retry_base · 2^(n-1) before attempt n + 1, at most RETRY_BACKOFF_MAX_SECONDS.
        self._retry_backoff = Backoff(
            min(settings.retry_base_seconds, RETRY_BACKOFF_MAX_SECONDS),
            RETRY_BACKOFF_MAX_SECONDS,
            jitter=0.0,
        )
        # (deal, consumer) -> loop time its own pending entries were last read; deal ->
        # loop time dead consumers were last looked for.
        self._own_read: dict[tuple[int, str], float] = {}
        self._checked: dict[int, float] = {}
        # Drain slot -> monotonic time the deals in queue mode the set did not name
        # were last walked (`_drain_unnamed`).
        self._unnamed_walked: dict[int, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """GATE_QUEUE_DRAINS drain loops, each a consumer of its own (so a deal has
        that many groups in flight per process, as sync mode keeps two)."""
        await asyncio.gather(*(self._loop(stop, slot) for slot in range(self.drains)))

    async def _loop(self, stop: asyncio.Event, slot: int) -> None:
        idle = IDLE_MIN_SECONDS
        wake = self.service.wake
        loop = asyncio.get_running_loop()
        linger = self.settings.linger_seconds
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                wake.clear()
                started = loop.time()
                done = 0
                try:
                    done = await self.run_once(slot)
                except Exception as exc:
                    log.warning("queue pass failed: %r", exc)
                    # Entries read by the failed pass stay pending under this consumer:
                    # read its own pending entries again at the next pass.
                    self._own_read.clear()
                if done:
                    idle = IDLE_MIN_SECONDS
                    if done < self.settings.batch_max and linger > 0:
                        # A partial batch: the next pass starts GATE_QUEUE_LINGER_SECONDS
                        # after this one started, so that a flood of requests is committed
                        # in full groups (fewer passes, each costing round trips and a
                        # transaction) rather than a few at a time.
                        await asyncio.wait((stopping,), timeout=started + linger - loop.time())
                    continue
                waking = asyncio.ensure_future(wake.wait())
                try:
                    await asyncio.wait((stopping, waking), timeout=idle)
                finally:
                    waking.cancel()
                idle = IDLE_MIN_SECONDS if wake.is_set() else min(idle * 2, IDLE_MAX_SECONDS)
        finally:
            stopping.cancel()

    def consumer_name(self, slot: int = 0) -> tuple[str, str]:
        """(owner, consumer name): a consumer is named by its process's lease, so that
        once that lease is gone its entries are taken over at once (`_claim_dead`)."""
        owner = self.gate.lease.owner
        return owner, f"{owner}-{slot}"

    async def run_once(self, slot: int = 0) -> int:
        """One bounded batch per deal with a queue; how many entries it settled."""
        raw = await self.gate.redis.srandmember(QUEUE_DEALS, DEALS_PER_PASS_MAX)
        named = [int(deal) for deal in raw or []]
        settled = 0
        for deal_id in named:
            settled += await self.drain(deal_id, slot)
        now = time.monotonic()
        if now - self._unnamed_walked.get(slot, -1e9) >= UNNAMED_WALK_SECONDS:
            self._unnamed_walked[slot] = now
            settled += await self._drain_unnamed(named, slot)
        return settled

    async def _drain_unnamed(self, named: list[int], slot: int) -> int:
        """The deals in queue mode (as this process last read the modes) that the set
        did not name. The set is only a record of queues, which a Redis that lost it
        (flushed, failed over to a copy without it) has back when a process that
        queued to the deal announces it again; had that process died first, its
        requests queued since the loss would wait for a restart. A deal found with
        entries is named again, so the next passes take it as before."""
        unnamed = self.service.modes.queued.difference(named)
        room = DEALS_PER_PASS_MAX - len(named)
        deals = random.sample(sorted(unnamed), room) if len(unnamed) > room else unnamed
        settled = 0
        for deal_id in deals:
            done = await self.drain(deal_id, slot)
            if done:
                await self.gate.redis.sadd(QUEUE_DEALS, str(deal_id))
                settled += done
        return settled

    async def _ensure_group(self, stream: str, deal_id: int) -> None:
        if deal_id in self._groups:
            return
        try:
            await self.gate.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        if len(self._groups) < TRACKED_MAX:
            self._groups.add(deal_id)

    async def drain(self, deal_id: int, slot: int = 0) -> int:
        try:
            return await self._drain(deal_id, slot)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream lost its group: Redis was flushed, or failed over to a copy
            # without it. The next pass makes it again, from the stream's first entry
            # (the entries queued since), instead of failing every pass until a restart.
            self._groups.discard(deal_id)
            log.warning("deal %s: the queue's consumer group is gone; made again", deal_id)
            return 0

    async def _drain(self, deal_id: int, slot: int) -> int:
        """One bounded batch of the deal's queue picked, parsed and settled."""
        stream = queue_keys(deal_id).stream
        await self._ensure_group(stream, deal_id)
        owner, name = self.consumer_name(slot)
        picked = await self._pick(deal_id, stream, owner, name)
        if not picked:
            return 0
        entries = await self._parse_picked(stream, picked)
        return await self._settle(deal_id, entries, owner)

    async def _pick(self, deal_id: int, stream: str, owner: str, name: str) -> list[Any]:
        """At most GATE_QUEUE_BATCH_MAX (entry id, fields) pairs: its own pending entries
        whose backoff has passed, what other consumers left (now and then), new ones."""
        room = self.settings.batch_max
        now = asyncio.get_running_loop().time()
        picked = await self._own_due(deal_id, stream, name, room, now)
        if now - self._checked.get(deal_id, -1e9) >= RECHECK_SECONDS:
            # Now and then, per deal: what dead consumers left, and the gauges.
            if len(self._checked) >= TRACKED_MAX:
                self._checked.clear()
            self._checked[deal_id] = now
            picked.extend(await self._left_by_others(stream, owner, name, room - len(picked)))
            await self._observe(deal_id, stream)
        if len(picked) < room:
            new: Any = await self.gate.redis.xreadgroup(
                GROUP, name, {stream: ">"}, count=room - len(picked)
            )
            for _, delivered in new or []:
                picked.extend(delivered)
        return picked

    async def _own_due(
        self, deal_id: int, stream: str, name: str, room: int, now: float
    ) -> list[Any]:
        """Its own pending entries whose retry backoff has passed (failed attempts, a
        pass that failed half-way): read while retries wait, else now and then."""
        due: list[Any] = []
        if self._next_try or now - self._own_read.get((deal_id, name), -1e9) >= RECHECK_SECONDS:
            if len(self._own_read) >= TRACKED_MAX:
                self._own_read.clear()
            self._own_read[(deal_id, name)] = now
            own: Any = await self.gate.redis.xreadgroup(GROUP, name, {stream: "0"}, count=room)
            for _, delivered in own or []:
                for entry_id, fields in delivered:
                    if self._next_try.get(text(entry_id), 0.0) <= now:
                        due.append((entry_id, fields))
        return due

    async def _left_by_others(self, stream: str, owner: str, name: str, room: int) -> list[Any]:
        """At most `room` entries other consumers left pending: those of dead gates at
        once, then any idle past GATE_QUEUE_CLAIM_IDLE_SECONDS (one whose lease could not
        be proven gone, a name from before leases named them)."""
        taken: list[Any] = []
        if room > 0:
            taken.extend(await self._claim_dead(stream, owner, name, room))
        if len(taken) < room:
            claimed: Any = await self.gate.redis.xautoclaim(
                stream, GROUP, name, self.claim_idle_ms, start_id="0-0", count=room - len(taken)
            )
            taken.extend(claimed[1] if claimed else [])
        return taken

    async def _parse_picked(self, stream: str, picked: list[Any]) -> list[Entry]:
        """The picked entries parsed, each once; one with nothing left to settle (trimmed
        while pending, or not ours to read) is acknowledged."""
        entries: list[Entry] = []
        seen: set[str] = set()
        for entry_id, fields in picked:
            entry = Entry.parse(entry_id, fields) if fields else None
            if entry is None:
                await self._ack(stream, text(entry_id))
                continue
            if entry.entry_id not in seen:
                seen.add(entry.entry_id)
                entries.append(entry)
        return entries

    async def _claim_dead(self, stream: str, owner: str, name: str, room: int) -> list[Any]:
        """The pending entries of consumers whose process is gone (its lease lapsed and
        its recorded server threads ended: nothing of its can commit any more), taken
        over at once rather than after GATE_QUEUE_CLAIM_IDLE_SECONDS."""
        redis = self.gate.redis
        infos: Any = await redis.xinfo_consumers(stream, GROUP)
        holders: dict[str, list[str]] = {}
        idle_empty: dict[str, list[str]] = {}
        for info in infos[:CONSUMERS_SEEN_MAX]:
            cname = text(info["name"])
            other = _owner_of(cname)
            if other is None or other == owner:
                continue
            if int(info["pending"]) > 0:
                holders.setdefault(other, []).append(cname)
            elif int(info["idle"]) > FORGET_IDLE_MS:
                idle_empty.setdefault(other, []).append(cname)
        picked: list[Any] = []
        if holders:
            dead = await self.gate.janitor.dead_owners(holders)
            for other in sorted(dead):
                for cname in holders[other]:
                    if len(picked) >= room:
                        break
                    rows: Any = await redis.xpending_range(
                        stream, GROUP, "-", "+", room - len(picked), consumername=cname
                    )
                    ids = [row["message_id"] for row in rows]
                    if not ids:
                        continue
                    claimed: Any = await redis.xclaim(stream, GROUP, name, 0, ids)
                    picked.extend(claimed or [])
                    log.warning(
                        "queue: took over %d entries of %s (its gate is gone)", len(ids), cname
                    )
        if idle_empty:
            # Long idle, nothing pending, lease gone: forgotten (the list stays short).
            alive = await self._leases_alive(list(idle_empty))
            for other, names in idle_empty.items():
                if other not in alive:
                    for cname in names:
                        await redis.xgroup_delconsumer(stream, GROUP, cname)
        return picked

    async def _leases_alive(self, owners: list[str]) -> set[str]:
        pipe = self.gate.redis.pipeline(transaction=False)
        for other in owners:
            pipe.exists(owner_keys(other).lease)
        found = await pipe.execute()
        return {o for o, alive in zip(owners, found, strict=True) if alive}

    async def _observe(self, deal_id: int, stream: str) -> None:
        depth = int(await self.gate.redis.xlen(stream))
        label = str(deal_id)
        DEPTH.labels(label).set(depth)
        age = 0.0
        if depth:
            first: Any = await self.gate.redis.xrange(stream, "-", "+", count=1)
            if first:
                age = max(0.0, time.time() - int(text(first[0][0]).split("-")[0]) / 1000)
        OLDEST_AGE.labels(label).set(age)

    async def _ack(self, stream: str, entry_id: str) -> None:
        await self.gate.runner.call("queue_ack", (stream,), (GROUP, entry_id))
        self._next_try.pop(entry_id, None)

    async def _settle(self, deal_id: int, entries: list[Entry], owner: str) -> int:
        qk = queue_keys(deal_id)
        ttl_ms = self.service.status_ttl_ms
        takes = await self.gate.runner.call(
            "queue_take", [qk.status(e.token) for e in entries], (ttl_ms,)
        )
        to_commit: list[Entry] = []
        settled = 0
        for entry, (code, detail, attempts) in zip(entries, takes, strict=True):
            if int(code) == 1:
                # Rejected or cancelled before: make sure the units went back (and a
                # dead letter's row exists: its consumer may have died before it).
                if str(detail) == "X|DEAD_LETTER":
                    await self._dead_letter_row(
                        deal_id, entry, self.settings.attempts_max, "(recorded by a later pass)"
                    )
                await self._rejection_row(deal_id, entry, str(detail)[2:])
                await self._give_back(deal_id, entry)
                await self._ack(qk.stream, entry.entry_id)
                settled += 1
                continue
            entry.attempts = int(attempts) if int(code) == 0 else 1
            to_commit.append(entry)
        if not to_commit:
            return settled
        # An earlier attempt may have committed (its answer lost, its consumer killed).
        held = await self._committed({e.token for e in to_commit if e.attempts > 1})
        if held:
            fresh: list[Entry] = []
            for e in to_commit:
                if e.token in held:
                    await self._committed_entry(deal_id, e, held[e.token])
                    settled += 1
                else:
                    fresh.append(e)
            to_commit = fresh
        if not to_commit:
            return settled
        outcomes = await self._commit(deal_id, to_commit, owner)
        committed = [(e, o) for e, o in zip(to_commit, outcomes, strict=True) if isinstance(o, str)]
        if committed:
            await self._committed_entries(deal_id, committed)

        async def settle(entry: Entry, outcome: DbCode | BaseException) -> int:
            if isinstance(outcome, DbCode):
                return int(await self._reject(deal_id, entry, _reason(outcome)))
            return await self._failed(deal_id, entry, outcome)

        rest = await asyncio.gather(
            *(
                settle(e, o)
                for e, o in zip(to_commit, outcomes, strict=True)
                if not isinstance(o, str)
            )
        )
        return settled + len(committed) + sum(rest)

    async def _committed(self, tokens: set[str]) -> dict[str, str]:
        if not tokens:
            return {}
        rows = await store.committed_orders(self.gate.db, tuple(sorted(tokens)))
        return {str(r[0]): str(r[1]) for r in rows}

    async def _commit(
        self, deal_id: int, entries: list[Entry], owner: str
    ) -> list[str | DbCode | BaseException]:
        """Per entry: its committed allocation, the database's refusal, or the error.
        Every transaction runs on a connection recorded under the consumer's lease
        (gate/store/process_lease.py): once that lease is gone and those threads ended, nothing of
        this consumer can commit any more, and its entries are taken over at once."""
        lease = self.gate.lease
        owners = {owner}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_seconds
        grouped = [e for e in entries if "," not in e.alloc]
        if len(grouped) > 1 and len(grouped) == len(entries):
            items = orjson.dumps(
                [
                    [
                        e.token,
                        e.user_id,
                        e.quantity,
                        int(e.alloc.split(":")[0]),
                        e.idempotency_key,
                        e.fingerprint,
                    ]
                    for e in entries
                ]
            ).decode()
            try:
                row = await reservation_call(
                    self.gate.db,
                    store.RESERVE_GROUP,
                    (deal_id, items),
                    deadline,
                    len(entries),
                    lease,
                    owners,
                )
            except OutcomeUnknown as exc:
                await self._thread_gone(exc)
                return [exc] * len(entries)
            except DbUnavailable as exc:
                return [exc] * len(entries)
            except (pymysql.err.MySQLError, TimeoutError):
                row = (int(DbCode.FALL_BACK),)
            code = DbCode(int(row[0]))
            if code == DbCode.OK:
                nb = int(row[5])
                return [f"{int(e.alloc.split(':')[0]) % nb}:{e.quantity}" for e in entries]
            if code in (DbCode.NOT_FOUND, DbCode.NOT_ACTIVE):
                return [code] * len(entries)
        slots = asyncio.Semaphore(SINGLES_CONCURRENCY)

        async def single(e: Entry) -> str | DbCode | BaseException:
            async with slots:
                try:
                    row = await reservation_call(
                        self.gate.db,
                        store.RESERVE_ONE,
                        (
                            e.token,
                            deal_id,
                            e.user_id,
                            e.quantity,
                            e.alloc,
                            e.idempotency_key,
                            e.fingerprint,
                            f"user:{e.user_id}",
                        ),
                        loop.time() + self.timeout_seconds,
                        1,
                        lease,
                        owners,
                    )
                except OutcomeUnknown as exc:
                    await self._thread_gone(exc)
                    return exc
                except Exception as exc:
                    return exc
            code = DbCode(int(row[0]))
            if code == DbCode.OK:
                return str(row[1])
            # Any refusal may hide an earlier commit of this very request (a group whose
            # connection was killed after its COMMIT answered an error; gate_reserve
            # checks stock before it meets the order id): the order decides.
            try:
                held = await self._committed({e.token})
            except Exception as exc:
                return exc
            if e.token in held:
                return held[e.token]
            return code

        return list(await asyncio.gather(*(single(e) for e in entries)))

    async def _thread_gone(self, exc: OutcomeUnknown) -> None:
        """A lost connection's server thread is ended before the entry is retried or
        given up, so the database's answer afterwards is final."""
        try:
            await self.gate.db.end_thread_of(exc)
        except Exception as wait_exc:
            log.warning("queue: thread %s not seen gone: %r", exc.thread_id, wait_exc)

    async def _committed_entry(self, deal_id: int, e: Entry, alloc: str) -> None:
        await self._committed_entries(deal_id, [(e, alloc)])

    async def _committed_entries(self, deal_id: int, done: list[tuple[Entry, str]]) -> None:
        """Confirm committed entries (the runner pipelines the scripts), then drop
        their statuses and acknowledge them in one call (queue_ack.lua)."""
        keys = deal_keys(deal_id)
        qk = queue_keys(deal_id)
        await asyncio.gather(
            *[
                self.gate.mirror.confirm_call(
                    keys, e.user_id, e.idempotency_key, e.token, e.fingerprint, alloc
                )
                for e, alloc in done
            ]
        )
        await self.gate.runner.call(
            "queue_ack",
            (qk.stream, *(qk.status(e.token) for e, _ in done)),
            (GROUP, *(e.entry_id for e, _ in done)),
        )
        now = time.time()
        for e, _ in done:
            self._next_try.pop(e.entry_id, None)
            COMMIT_LAG.observe(max(0.0, now - e.enqueued_ms / 1000))
        COMMITTED.labels(str(deal_id)).inc(len(done))

    async def _fence(self, deal_id: int, e: Entry, reason: str) -> bool:
        """The final status "X|REASON", only if this attempt still owns the entry (a
        consumer that took it over meanwhile, after this one stalled, decides it
        instead): False then, and nothing is to be done with it here."""
        code, _detail = await self.gate.runner.call(
            "queue_reject",
            (queue_keys(deal_id).status(e.token),),
            (e.attempts, reason, self.service.status_ttl_ms),
        )
        if int(code) == 2:
            log.warning("queue: order %s was taken over; its rejection is left", e.token)
            return False
        return True

    async def _reject(self, deal_id: int, e: Entry, reason: str) -> bool:
        """The final status first (fenced), then the units back (acts once) and the
        entry acknowledged."""
        if not await self._fence(deal_id, e, reason):
            return False
        await self._rejection_row(deal_id, e, reason)
        await self._give_back(deal_id, e)
        await self._ack(queue_keys(deal_id).stream, e.entry_id)
        REJECTED.labels(str(deal_id), reason).inc()
        return True

    async def _give_back(self, deal_id: int, e: Entry) -> None:
        if await self.gate.mirror.compensate(
            deal_keys(deal_id), e.user_id, e.idempotency_key, e.token
        ):
            METRICS.compensations.inc()
            self.gate.soldout.forget(deal_id)

    async def _failed(self, deal_id: int, e: Entry, exc: BaseException) -> int:
        """A transient failure: retried after a backoff, or a dead letter."""
        if e.attempts < self.settings.attempts_max:
            RETRIES.labels(str(deal_id)).inc()
            backoff = self._retry_backoff.delay_seconds(e.attempts)
            if len(self._next_try) >= TRACKED_MAX:
                self._next_try.clear()
            self._next_try[e.entry_id] = asyncio.get_running_loop().time() + backoff
            log.info("queue: order %s attempt %d failed: %r", e.token, e.attempts, exc)
            return 0
        # The last attempt failed: a committed order (an answer lost) is confirmed,
        # anything else becomes a dead letter for a person.
        held = await self._committed({e.token})
        if e.token in held:
            await self._committed_entry(deal_id, e, held[e.token])
            return 1
        # Fenced first (a consumer that took the entry over decides instead), then the
        # row, then the units back and the acknowledgement: a consumer killed between
        # leaves "X|DEAD_LETTER", and whoever meets the entry next writes the row
        # (`_dead_letter_row`, idempotent) before acknowledging it.
        if not await self._fence(deal_id, e, "DEAD_LETTER"):
            return 0
        await self._dead_letter_row(deal_id, e, e.attempts, repr(exc)[:LAST_ERROR_MAX_CHARS])
        await self._rejection_row(deal_id, e, "DEAD_LETTER")
        await self._give_back(deal_id, e)
        await self._ack(queue_keys(deal_id).stream, e.entry_id)
        REJECTED.labels(str(deal_id), "DEAD_LETTER").inc()
        log.error(
            "queue: order %s of deal %s dead-lettered after %d attempts: %r",
            e.token,
            deal_id,
            e.attempts,
            exc,
        )
        DEAD_LETTERS.labels(str(deal_id)).inc()
        return 1

    async def _dead_letter_row(self, deal_id: int, e: Entry, attempts: int, error: str) -> None:
        await store.dead_letter(
            self.gate.db,
            (e.token, deal_id, e.user_id, e.quantity, e.idempotency_key, attempts, error),
        )

    async def _rejection_row(self, deal_id: int, e: Entry, reason: str) -> None:
        """The rejected order's `order.rejected` outbox row, written once (its event id
        is the order id, which no other outbox row uses: a rejected order never
        reaches `orders`)."""
        await store.rejection_outbox(
            self.gate.db, e.token, deal_id, e.user_id, e.quantity, reason[:64]
        )
