"""The expiry sweeper: gives the stock of holds whose deadline has passed back.

One batch is one short transaction and two Redis calls per deal:

  1. START TRANSACTION; take up to `batch_max` due orders, oldest deadline first,
     with `SELECT … FOR UPDATE SKIP LOCKED` (any number of sweepers share the work;
     an order a payment or a cancel is working on is skipped, not waited for).
     "Due" is judged by the database clock, NOW(6), whoever moved `expires_at`.
  2. Record one Redis intent per order (mirror.intend): the release may commit.
  3. CALL gate_expire_batch (db/routines/gate_expire_batch.sql): the conditional transition to
     EXPIRED, one write per bucket, ledger rows carrying each order's intent id,
     quota, outbox, COMMIT; one round trip, set-based, linear in the batch.
  4. Apply the intents to Redis (mirror.apply): counters and the sold-out state
     come back exactly once; a sweeper that dies before this leaves the intents to
     the janitor, which applies them because the ledger holds their ids.

When the outcome of step 3 is not known (the connection broke), the sweeper makes
sure the server thread has ended and asks the ledger, exactly like a reservation
whose COMMIT outcome is unknown; if the database cannot be asked, the intents stay
for the janitor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson
import pymysql

from gate.base import tracing
from gate.base.backoff import Backoff
from gate.base.drain import mark_draining
from gate.base.ids import new_ids
from gate.base.metrics import METRICS
from gate.inventory.mirror import Intent, Mirror
from gate.store.db import (
    DEADLOCK_BACKOFF,
    Database,
    OutcomeUnknown,
    errno_of,
    is_connection_error,
    is_retryable,
    procedure_span,
)

log = logging.getLogger("gate.sweeper")

HOLDING = ("PENDING_PAYMENT", "AUTHORIZED")
# The shortest pause after a short batch. Holds falling due one after another are
# then released in batches of up to this much time, not one transaction each, and
# due rows another sweeper holds locked are not polled in a busy loop.
NEXT_DUE_PAUSE_MIN_SECONDS = 0.05
# Deadlocks and lock-wait timeouts (a rebucketing, a hot bucket) are retried at
# once this many times; a deadlock counts as failed on the last attempt only, a
# lock-wait timeout on every attempt (see Sweeper._decided).
BATCH_ATTEMPTS_MAX = 3
LOCK_WAIT_TIMEOUT = 1205
LOOKUP_CHUNK = 1000
# A scan continues where the last full batch ended for at most this long, then starts
# from the beginning of the due range again (see Sweeper._take).
SCAN_RESTART_SECONDS = 1.0
FAILURE_PAUSE_MAX_SECONDS = 2.0
LAG_BUCKETS_SECONDS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)

RELEASED = METRICS.counter(
    "gate_expiry_released_total",
    "Holds released by the expiry sweeper (orders moved to EXPIRED, stock given back).",
)
RELEASE_FAILURES = METRICS.counter(
    "gate_expiry_release_failures_total",
    "Holds whose release attempt did not commit (retried deadlocks excluded).",
)
RELEASE_LAG = METRICS.histogram(
    "gate_expiry_release_lag_seconds",
    "Time from a hold's expires_at (database clock) until its release committed.",
    buckets=LAG_BUCKETS_SECONDS,
)


@dataclass
class SweepStats:
    """Process-local totals, read by the invariant monitor for the failure ratio."""

    released: int = 0
    failed: int = 0
    lag_sum: float = 0.0  # seconds, summed over the holds released
    batches: int = 0
    retries: int = 0
    unresolved: int = 0


STATS = SweepStats()


@dataclass(frozen=True)
class SweepConfig:
    batch_max: int = 1000
    interval_seconds: float = 0.5
    tasks: int = 1
    batch_timeout_seconds: float = 30.0


@dataclass(frozen=True)
class Due:
    order_id: str
    deal_id: int
    user_id: int
    quantity: int
    alloc: str
    overdue_seconds: float  # NOW(6) - expires_at when the batch was taken


@dataclass
class Batch:
    orders: list[Due]
    taken_at: float = field(default_factory=time.monotonic)
    intents: list[Intent] = field(default_factory=list)  # one per order, same order

    def by_deal(self) -> dict[int, list[Intent]]:
        groups: dict[int, list[Intent]] = defaultdict(list)
        for due, intent in zip(self.orders, self.intents, strict=True):
            groups[due.deal_id].append(intent)
        return dict(groups)


def default_actor() -> str:
    return f"sweeper:{socket.gethostname()[:40]}:{os.getpid()}"


class Sweeper:
    def __init__(
        self,
        db: Database,
        mirror: Mirror,
        config: SweepConfig,
        *,
        actor: str | None = None,
    ) -> None:
        self.db = db
        self.mirror = mirror
        self.config = config
        self.actor = (actor or default_actor())[:64]
        # Per holding status, where the last full batch ended ((expires_at, id)) and
        # when the scan last started from the beginning (see _take).
        self._after: dict[str, tuple[str, str]] = {}
        self._scan_started = 0.0
        # After a failed batch: twice the interval, doubling, at most
        # FAILURE_PAUSE_MAX_SECONDS (or the interval, when that is longer).
        interval = config.interval_seconds
        cap = max(interval, FAILURE_PAUSE_MAX_SECONDS)
        self._failure_backoff = Backoff(min(2 * interval, cap), cap, jitter=0.0)

    # -- loops -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep until `stop` is set, with `config.tasks` batches in flight at most."""
        await asyncio.gather(*(self._loop(stop) for _ in range(self.config.tasks)))

    async def _loop(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            pause = self.config.interval_seconds
            try:
                released = await self.run_once()
                failures = 0
            except Exception as exc:
                log.warning("expiry batch failed: %r", exc)
                released = 0
                # The database or Redis may be down: back off a little, but never so
                # far that a hold would wait long once they are back.
                failures = min(failures + 1, 8)
                pause = self._failure_backoff.delay_seconds(failures)
            if released >= self.config.batch_max:
                mark_draining()
            else:
                if failures == 0:
                    pause = await self._until_next_due(pause)
                try:
                    await asyncio.wait_for(stop.wait(), pause)
                except TimeoutError:
                    pass

    async def _until_next_due(self, pause: float) -> float:
        """The pause after a short batch, cut to when the next hold falls due.

        A flash sale's holds fall due together (one hold time after the crowd), so
        waking at the deadline instead of up to a whole interval later is most of
        the time between "due" and "sellable again". The interval stays the upper
        bound: an operator may move a deadline earlier at any time."""
        try:
            row = await self.db.fetchone(
                "SELECT TIMESTAMPDIFF(MICROSECOND, NOW(6), LEAST("
                "COALESCE((SELECT MIN(expires_at) FROM orders WHERE status = %s), '9999-12-31'),"
                "COALESCE((SELECT MIN(expires_at) FROM orders WHERE status = %s), '9999-12-31')"
                "))",
                HOLDING,
            )
        except Exception:
            return pause  # the next batch reports the trouble
        if row is None or row[0] is None:
            return pause
        # A millisecond past the deadline, so that `expires_at <= NOW(6)` holds on waking.
        return min(pause, max(NEXT_DUE_PAUSE_MIN_SECONDS, int(row[0]) / 1e6 + 0.001))

    async def sweep_due(self, batches_max: int = 10_000) -> int:
        """Release everything due now (batch after batch until one comes back short)."""
        total = 0
        for _ in range(batches_max):
            released = await self.run_once()
            total += released
            if released < self.config.batch_max:
                break
        return total

    # -- one batch -------------------------------------------------------------------

    async def run_once(self) -> int:
        """Release at most one batch of due holds; returns how many were released.

        Raises when the batch failed (its holds stay for the next batch). Traced: a
        root span once the batch has holds to release (an empty poll makes none)."""
        with tracing.background("expiry batch") as unit:
            released = await self._attempts()
            unit.set("gate.expiry.released", released)
            return released

    async def _attempts(self) -> int:
        for attempt in range(BATCH_ATTEMPTS_MAX):
            try:
                return await self._batch(last_attempt=attempt == BATCH_ATTEMPTS_MAX - 1)
            except pymysql.err.MySQLError as exc:
                if not is_retryable(exc) or attempt == BATCH_ATTEMPTS_MAX - 1:
                    raise
                STATS.retries += 1
                METRICS.db_retries.labels(str(errno_of(exc))).inc()
                await asyncio.sleep(DEADLOCK_BACKOFF.delay_seconds(attempt + 1))
        raise AssertionError("unreachable")

    async def _batch(self, *, last_attempt: bool) -> int:
        batch: Batch | None = None
        cursor: dict[str, tuple[str, str] | None] = {}
        try:
            async with self.db.connection() as conn:
                async with conn.cursor() as cur:
                    orders = await self._take(cur, cursor)
                    if not orders:
                        await cur.execute("COMMIT")
                        return 0
                    batch = Batch(orders)
                    await self._intend(batch)
                    row = await self._release(conn, cur, batch)
        except asyncio.CancelledError:
            if batch is not None:
                # Stopping mid-batch: the server may still commit it. The janitor
                # decides the intents against the ledger once they are old enough.
                log.warning(
                    "expiry batch of %d interrupted; left to the janitor", len(batch.orders)
                )
            raise
        except OutcomeUnknown as exc:
            assert batch is not None
            log.warning("expiry batch of %d: outcome unknown (%r)", len(batch.orders), exc.cause)
            committed = await self._resolve(exc, batch)
            return await self._decided(batch, committed, exc, last_attempt)
        except Exception as exc:
            if batch is None:
                raise
            # The CALL ended with an error and the transaction is over (the procedure
            # or the connection context rolled it back): the ledger tells whether it
            # had committed all the same.
            committed = await self._committed_or_none(batch)
            return await self._decided(batch, committed, exc, last_attempt)
        assert row is not None and int(row[0]) == 0, f"gate_expire_batch returned {row!r}"
        released = int(row[1])
        assert released == len(batch.orders), "a batch releases all its orders or none"
        for status, after in cursor.items():
            if after is None:
                self._after.pop(status, None)
            else:
                self._after[status] = after
        await self._apply(batch, True)
        self._released(batch)
        return released

    async def _decided(
        self, batch: Batch, committed: bool | None, exc: BaseException, last_attempt: bool
    ) -> int:
        """Finish a batch whose CALL did not answer normally; re-raise unless it committed.

        Both a deadlock and a lock-wait timeout are retried at once (run_once). A
        deadlock counts as a failure only on the last attempt: it is over in
        milliseconds and the retry normally succeeds. A lock-wait timeout counts on
        every attempt: the batch waited GATE_DB_LOCK_WAIT_SECONDS for a row another
        transaction held, and that long transaction must show in
        gate_expiry_release_failures_total (the release-failure alert reads it).
        Counting it only on the last attempt of one sweeper missed it: the rollback
        frees the batch's orders and, with several sweepers (tasks, workers, hosts),
        another one usually takes them before this one's retry, so no sweeper made
        three attempts in a row and nothing was ever counted."""
        if committed is None:
            STATS.unresolved += len(batch.orders)
            self._failed(batch, exc)
            raise exc
        await self._apply(batch, committed)
        if committed:
            log.warning("expiry batch committed although the call failed: %r", exc)
            self._released(batch)
            return len(batch.orders)
        retried = isinstance(exc, pymysql.err.MySQLError) and is_retryable(exc)
        if last_attempt or not retried or errno_of(exc) == LOCK_WAIT_TIMEOUT:
            self._failed(batch, exc)
        raise exc

    async def _take(self, cur: Any, cursor: dict[str, tuple[str, str] | None]) -> list[Due]:
        """Open the transaction and lock a batch of due holds, oldest deadline first.

        One index range per status, so the scan stops after `limit` rows: with
        `status IN (…)` the rows would be sorted after the scan, and every due row
        would be locked first.

        While a backlog drains, a scan continues after where the last full batch of
        this sweeper ended instead of at the start of the range: the orders released
        meanwhile leave delete-marked entries there until purge removes them, and
        stepping over them made each batch slower than the one before (a crowd's
        holds share one deadline, so they sit in one run of the index). The scan
        starts from the beginning again after a short batch and at least every
        `SCAN_RESTART_SECONDS`, so a hold passed over (locked by a payment then, or
        moved earlier by an operator) waits at most that much longer."""
        limit = self.config.batch_max
        found: list[Due] = []
        now = time.monotonic()
        if now - self._scan_started >= SCAN_RESTART_SECONDS:
            self._after.clear()
        if not self._after:
            self._scan_started = now
        # Until this batch has committed, the next scan starts from the beginning: a
        # batch that fails leaves its holds before the cursor it would have set.
        start, self._after = self._after, {}
        await cur.execute("START TRANSACTION")
        for status in HOLDING:
            want = limit - len(found)
            if want <= 0:
                break
            after = start.get(status)
            # One text column per row: the client parses rows in Python, and six typed
            # columns cost it about three times as much CPU as one.
            sql = (
                "SELECT CONCAT_WS('|', id, deal_id, user_id, quantity, alloc,"
                " TIMESTAMPDIFF(MICROSECOND, expires_at, NOW(6)), expires_at) FROM orders"
                " WHERE status = %s AND expires_at <= NOW(6)"
            )
            args: tuple[Any, ...] = (status,)
            if after is not None:
                sql += " AND (expires_at > %s OR (expires_at = %s AND id > %s))"
                args += (after[0], after[0], after[1])
            await cur.execute(
                sql + " ORDER BY expires_at, id LIMIT %s FOR UPDATE SKIP LOCKED", (*args, want)
            )
            rows = await cur.fetchall()
            for (text,) in rows:
                fields = str(text).split("|")
                order_id, deal_id, user_id, quantity, alloc, overdue_us, expires = fields
                found.append(
                    Due(
                        order_id,
                        int(deal_id),
                        int(user_id),
                        int(quantity),
                        alloc,
                        int(overdue_us) / 1e6,
                    )
                )
            # Where the next scan of this status starts once this batch has committed
            # (None: from the beginning; the due range is exhausted or all locked).
            cursor[status] = (expires, order_id) if len(rows) >= want else None
        return found

    async def _intend(self, batch: Batch) -> None:
        batch.intents = [
            Intent(id=intent_id, user_id=due.user_id, units=-due.quantity, deltas=due.alloc)
            for due, intent_id in zip(batch.orders, new_ids(len(batch.orders)), strict=True)
        ]
        groups = batch.by_deal()
        results = await asyncio.gather(
            *(self.mirror.intend(deal_id, intents) for deal_id, intents in groups.items()),
            return_exceptions=True,
        )
        for deal_id, result in zip(groups, results, strict=True):
            if isinstance(result, BaseException):
                # Without intents Redis cannot be told exactly; the resync loop
                # brings it to the database once the release has committed.
                log.warning("deal %s: release intents not recorded in Redis: %r", deal_id, result)

    async def _release(self, conn: Any, cur: Any, batch: Batch) -> tuple[Any, ...]:
        payload = orjson.dumps(
            [
                (due.order_id, intent.id)
                for due, intent in zip(batch.orders, batch.intents, strict=True)
            ]
        ).decode()

        async def call() -> tuple[Any, ...] | None:
            await cur.execute("CALL gate_expire_batch(%s, %s)", (payload, self.actor))
            row = await cur.fetchone()
            while await cur.nextset():
                pass
            return tuple(row) if row is not None else None

        try:
            with tracing.span(*procedure_span("CALL gate_expire_batch", self.db.node_of(conn))):
                row = await asyncio.wait_for(call(), self.config.batch_timeout_seconds)
        except Exception as exc:
            if is_connection_error(exc) or isinstance(exc, TimeoutError):
                raise self.db.outcome_unknown(conn, exc) from exc
            raise
        assert row is not None, "gate_expire_batch returned no row"
        return row

    # -- deciding the intents --------------------------------------------------------

    async def _resolve(self, exc: OutcomeUnknown, batch: Batch) -> bool | None:
        """The connection broke mid-batch: wait until the server thread is gone (its
        transaction is then over), then ask the ledger. None: cannot tell yet."""
        try:
            await self.db.end_thread_of(exc)
        except Exception as lookup_exc:
            log.warning("expiry batch left to the janitor: %r", lookup_exc)
            return None
        return await self._committed_or_none(batch)

    async def _committed_or_none(self, batch: Batch) -> bool | None:
        """Whether the batch committed, by its intent ids in the ledger (a batch
        commits whole or not at all). None: the database cannot be asked now."""
        ids = [i.id for i in batch.intents]
        try:
            found = 0
            for i in range(0, len(ids), LOOKUP_CHUNK):
                chunk = tuple(ids[i : i + LOOKUP_CHUNK])
                marks = ",".join(["%s"] * len(chunk))
                row = await self.db.fetchone(
                    f"SELECT COUNT(DISTINCT op_id) FROM inventory_ledger WHERE op_id IN ({marks})",
                    chunk,
                )
                found += int(row[0]) if row else 0
        except Exception as exc:
            log.warning("expiry batch: cannot look the outcome up, left to the janitor: %r", exc)
            return None
        assert found in (0, len(ids)), f"expiry batch partly committed: {found} of {len(ids)}"
        return found == len(ids)

    async def _apply(self, batch: Batch, committed: bool) -> None:
        groups = batch.by_deal()
        results = await asyncio.gather(
            *(
                self.mirror.apply(deal_id, [(i.id, committed) for i in intents])
                for deal_id, intents in groups.items()
            ),
            return_exceptions=True,
        )
        for deal_id, result in zip(groups, results, strict=True):
            if isinstance(result, BaseException):
                # The database holds the truth; the janitor resolves the intents later.
                log.warning("deal %s: release not yet applied in Redis: %r", deal_id, result)

    # -- accounting ------------------------------------------------------------------

    def _released(self, batch: Batch) -> None:
        n = len(batch.orders)
        STATS.released += n
        STATS.batches += 1
        RELEASED.inc(n)
        # Overdue when taken, plus the time the batch took (milliseconds; for a batch
        # resolved by lookup, an upper bound).
        took = time.monotonic() - batch.taken_at
        for due in batch.orders:
            lag = max(0.0, due.overdue_seconds + took)
            STATS.lag_sum += lag
            RELEASE_LAG.observe(lag)

    def _failed(self, batch: Batch, exc: BaseException) -> None:
        n = len(batch.orders)
        STATS.failed += n
        RELEASE_FAILURES.inc(n)
        log.warning("expiry batch of %d hold(s) not released: %r", n, exc)
