"""Group commit for reservations (DESIGN lever 5, docs/reservation-groups.md).

A process gathers the admitted reservations of one deal that arrive while its
previous groups of that deal are in the database, and applies them in one
`CALL gate_reserve_group` (db/006): one transaction, one statement per step for the
whole group, one COMMIT. No timer: a reservation that finds no group of its deal
in the database starts one at once (an idle gate adds no wait; a group of one is a
plain `gate_reserve`), the others queue and leave together with the next group. A
further group leaves beside one in the database (up to `in_flight_max`) only once a
quarter of `group_max` is queued: a few stragglers wait for the group in flight
rather than pay a transaction's fixed cost for one or two reservations. So a busy
gate amortises the round trip, the procedure's work and the COMMIT's log flush over
many reservations, and the bucket rows are locked once per group instead of once per
reservation.

The group is all or nothing and only for the common case. When the database would
answer one item differently from the others (a bucket short, a per-user limit, a
key it already holds), or the group fails with an error that is not a lost
connection, every item runs again on its own through the single path, which gives
each its exact answer. A lost connection or a deadline passed mid-call leaves the
whole group's outcome unknown: every item gets OutcomeUnknown and resolves it as a
single reservation would (the group committed all its orders or none).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pymysql

from gate.base import tracing
from gate.base.codes import DbCode
from gate.base.metrics import METRICS
from gate.base.timeouts import deadline_at
from gate.store.db import POOL_REFUSED, Database, DbUnavailable, OutcomeUnknown, is_connection_error
from gate.store.process_lease import Lease

log = logging.getLogger("gate.groups")

GROUP_SIZE = METRICS.histogram(
    "gate_reservation_group_size",
    "Reservations applied together in one database transaction (1: a single reservation).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
GROUP_RERUNS = METRICS.counter(
    "gate_reservation_group_reruns_total",
    "Reservations of a group that could not commit whole, run again one at a time"
    " (reason: differs, an item would be answered differently; error, the group failed).",
    ["reason"],
)
DB_ATTEMPTS = METRICS.counter(
    "gate_reservation_db_attempts_total",
    "Reservations sent to the database: each reservation of a group counts, and so does"
    " every retry.",
)
TRANSACTION_SECONDS = METRICS.db_transaction_seconds

# Hard bounds on the settings (a group's JSON must stay far below max_allowed_packet).
GROUP_MAX_LIMIT = 512
IN_FLIGHT_MAX_LIMIT = 64
# While a group of a deal is in the database, the next leaves beside it only with at
# least 1/FOLLOW_SHARE of GATE_RESERVATION_GROUP_MAX queued (docs/reservation-groups.md).
FOLLOW_SHARE = 4


@dataclass(frozen=True)
class Item:
    """One admitted reservation whose Redis allocation names a single bucket."""

    token: str
    user_id: int
    quantity: int
    bucket: int
    idempotency_key: str
    fingerprint: str
    deadline: float  # event-loop time by which its database part must be over
    # The lease id its in-flight marker names (gate/store/process_lease.py); None: no marker (the
    # database-only path while Redis is down).
    owner: str | None = None

    def as_json(self) -> list[Any]:
        return [
            self.token,
            self.user_id,
            self.quantity,
            self.bucket,
            self.idempotency_key,
            self.fingerprint,
        ]


Row = tuple[Any, ...]
# The single path: one reservation of a deal through gate_reserve, within its deadline.
Single = Callable[[int, Item], Awaitable[Row]]


class _Pending:
    __slots__ = ("due", "future", "item", "trace")

    def __init__(self, item: Item, future: asyncio.Future[Row], due: float) -> None:
        self.item = item
        self.future = future
        self.due = due  # event-loop time by which it must have left in a group
        # The request's trace, for the group's span (gate/base/tracing.py `serving`).
        self.trace = tracing.current() if tracing.ENABLED else None


class ReservationGroups:
    def __init__(
        self,
        db: Database,
        single: Single,
        group_max: int,
        in_flight_max: int,
        queue_wait_seconds: float,
        lease: Lease | None = None,
    ) -> None:
        assert 1 <= group_max <= GROUP_MAX_LIMIT, "group_max out of bounds"
        assert 1 <= in_flight_max <= IN_FLIGHT_MAX_LIMIT, "in_flight_max out of bounds"
        self.db = db
        self.single = single
        self.lease = lease
        self.group_max = group_max
        self.in_flight_max = in_flight_max
        self.follow_min = max(1, group_max // FOLLOW_SHARE)
        # A queued reservation waits no longer for its group to leave than it would
        # for a pooled connection: a saturated database answers 503 soon, as before.
        self.queue_wait_seconds = queue_wait_seconds
        self._queues: dict[int, list[_Pending]] = {}
        self._in_flight: dict[int, int] = {}
        self._kick_scheduled: set[int] = set()
        # One queue-wait timer per deal with a queue, armed for its oldest reservation
        # (the queue is in arrival order), rather than one per reservation.
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def reserve(self, deal_id: int, item: Item) -> Row:
        """The reservation's database answer, as gate_reserve's row: (code, alloc,
        expires_at, created_at, unit_price, currency). Raises what the single path
        raises (OutcomeUnknown, DbUnavailable, MySQLError, TimeoutError)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(item, loop.create_future(), loop.time() + self.queue_wait_seconds)
        self._queues.setdefault(deal_id, []).append(pending)
        # Started at the end of this loop turn, so that every reservation admitted by
        # the same Redis reply joins the same group.
        if deal_id not in self._kick_scheduled:
            self._kick_scheduled.add(deal_id)
            loop.call_soon(self._kick, deal_id)
        if deal_id not in self._timers:
            self._timers[deal_id] = loop.call_at(pending.due, self._give_up, deal_id)
        # Awaited directly (no shield: one future and one loop turn less per
        # reservation). A caller that goes away cancels only its own future; the group
        # settles only the futures still waiting, so its other items are not touched.
        return await pending.future

    def _give_up(self, deal_id: int) -> None:
        """The deal's oldest queued reservations waited their limit: its groups are
        stuck in the database. Then the timer is armed again for the oldest left."""
        del self._timers[deal_id]
        queue = self._queues.get(deal_id)
        if not queue:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        late = 0
        while late < len(queue) and queue[late].due <= now:
            late += 1
        for pending in queue[:late]:
            POOL_REFUSED.labels("reservation").inc()
            if not pending.future.done():
                pending.future.set_exception(
                    DbUnavailable("the reservations' share of the database is busy")
                )
        del queue[:late]
        if queue:
            self._timers[deal_id] = loop.call_at(queue[0].due, self._give_up, deal_id)
        else:
            self._queues.pop(deal_id, None)

    def _kick(self, deal_id: int) -> None:
        self._kick_scheduled.discard(deal_id)
        queue = self._queues.get(deal_id)
        while queue:
            flying = self._in_flight.get(deal_id, 0)
            # With a group of the deal in the database, another leaves only once it
            # would be worth its fixed cost: a few stragglers wait for the group in
            # flight instead of going as a group of one or two.
            if flying >= self.in_flight_max or (flying and len(queue) < self.follow_min):
                break
            group = queue[: self.group_max]
            del queue[: self.group_max]
            self._in_flight[deal_id] = flying + 1
            task = asyncio.get_running_loop().create_task(self._run(deal_id, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not queue:
            self._queues.pop(deal_id, None)

    async def _run(self, deal_id: int, group: list[_Pending]) -> None:
        # Traced: the group's CALL is one span, linked to and from each traced request.
        with tracing.serving(p.trace for p in group):
            await self._run_traced(deal_id, group)

    async def _run_traced(self, deal_id: int, group: list[_Pending]) -> None:
        try:
            GROUP_SIZE.observe(len(group))
            if len(group) == 1:
                await self._settle(group[0], self.single(deal_id, group[0].item))
            else:
                await self._run_group(deal_id, group)
        except BaseException as exc:  # never leave a caller waiting
            for p in group:
                if not p.future.done():
                    p.future.set_exception(
                        exc if isinstance(exc, Exception) else DbUnavailable("cancelled")
                    )
            if not isinstance(exc, Exception):
                raise
        finally:
            left = self._in_flight.get(deal_id, 1) - 1
            if left > 0:
                self._in_flight[deal_id] = left
            else:
                self._in_flight.pop(deal_id, None)
            if self._queues.get(deal_id):
                self._kick(deal_id)

    @staticmethod
    async def _settle(p: _Pending, answer: Awaitable[Row]) -> None:
        try:
            row = await answer
        except Exception as exc:
            if not p.future.done():
                p.future.set_exception(exc)
            return
        if not p.future.done():
            p.future.set_result(row)

    async def _run_group(self, deal_id: int, group: list[_Pending]) -> None:
        try:
            row = await self._call(deal_id, group)
        except (OutcomeUnknown, DbUnavailable) as exc:
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        except Exception as exc:
            # The group rolled back whole (retries spent on deadlocks, a failed
            # statement, a bug): each item on its own gets its exact answer.
            if not isinstance(exc, pymysql.err.MySQLError | TimeoutError):
                log.exception("reservation group of %d failed unexpectedly", len(group))
            GROUP_RERUNS.labels("error").inc(len(group))
            await self._one_by_one(deal_id, group)
            return
        code = DbCode(int(row[0]))
        if code == DbCode.OK:
            expires_at, created_at, unit_price, currency, buckets = row[1:6]
            nb = int(buckets)
            for p in group:
                if p.future.done():
                    continue  # its caller went away
                it = p.item
                p.future.set_result(
                    (
                        int(DbCode.OK),
                        f"{it.bucket % nb}:{it.quantity}",
                        expires_at,
                        created_at,
                        unit_price,
                        currency,
                    )
                )
            return
        if code in (DbCode.NOT_FOUND, DbCode.NOT_ACTIVE):
            for p in group:
                if not p.future.done():
                    p.future.set_result((int(code), "", None, None))
            return
        assert code == DbCode.FALL_BACK, f"gate_reserve_group answered {code!r}"
        GROUP_RERUNS.labels("differs").inc(len(group))
        await self._one_by_one(deal_id, group)

    async def _one_by_one(self, deal_id: int, group: list[_Pending]) -> None:
        await asyncio.gather(*(self._settle(p, self.single(deal_id, p.item)) for p in group))

    async def _call(self, deal_id: int, group: list[_Pending]) -> Row:
        """One gate_reserve_group call within the deadline of the group's earliest item."""
        items = orjson.dumps([p.item.as_json() for p in group]).decode()
        return await reservation_call(
            self.db,
            "CALL gate_reserve_group(%s, %s)",
            (deal_id, items),
            min(p.item.deadline for p in group),
            len(group),
            self.lease,
            {p.item.owner for p in group if p.item.owner},
        )

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def reservation_call(
    db: Database,
    sql: str,
    args: tuple[Any, ...],
    deadline: float,
    reservations: int,
    lease: Lease | None = None,
    owners: set[str] | None = None,
) -> Row:
    """A reservation procedure's CALL on the reservations' share of the pool, retried
    after deadlocks, within `deadline` (event-loop time). Once the call may have
    reached the server, a lost connection or the deadline leaves its outcome unknown
    (OutcomeUnknown names the server thread, so the caller can make sure it ended).

    The connection is first recorded under the lease of every owner of the tokens the
    call commits (`owners`), so that a janitor that finds an owner dead knows which
    server threads to wait for (gate/store/process_lease.py); DbUnavailable, before anything is
    sent, when an owner's lease has lapsed."""
    thread: list[Any] = []

    async def attempt() -> Row:
        async with db.reservation_connection() as conn:
            if lease is not None and owners:
                await lease.bind(conn, owners)
            thread[:] = [conn.thread_id(), conn.connected_time, db.node_of(conn)]
            DB_ATTEMPTS.inc(reservations)
            try:
                with TRANSACTION_SECONDS.time():
                    row = await db.call(conn, sql, args)
            except Exception as exc:
                if is_connection_error(exc):
                    raise OutcomeUnknown(thread[0], thread[1], exc, thread[2]) from exc
                raise
            assert row is not None, f"{sql.split('(')[0]} returned no row"
            return row

    try:
        # deadline_at rather than wait_for: no task made per call (and, unlike
        # asyncio.timeout_at on Python 3.11.2, no spurious CancelledError).
        async with deadline_at(deadline):
            return await db.retrying(attempt)
    except TimeoutError as exc:
        if thread:
            raise OutcomeUnknown(thread[0], thread[1], exc, thread[2]) from exc
        raise DbUnavailable("timed out waiting for a database connection") from exc
