"""The order/payment state machine: one provider fact in, one short transaction.

`apply` records the event and applies it (gate_payment_event, one round trip),
then runs what the procedure handed back: a late payment's settlement (it needs a
Redis intent before its transaction), and the events of the same order that were
waiting for this one. Everything here is idempotent: the event's primary key makes
a second delivery a no-op, and every follow-up re-checks state under a row lock.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from gate.base import tracing
from gate.base.ids import new_id
from gate.inventory.mirror import Mirror
from gate.payments import store
from gate.payments.codes import EventCode
from gate.payments.late import settle_late
from gate.payments.metrics import QUARANTINED
from gate.payments.provider import ProviderEvent
from gate.store.db import Database

if TYPE_CHECKING:
    from collections.abc import Sequence

log = logging.getLogger("gate.payments")

WAITING_BATCH_MAX = 20
# Group commit (gate_payment_event_group): at most this many callbacks per group, and
# at most this many groups of one process in the database at once. While a group
# commits, the callbacks arriving meanwhile gather into the next one, so a quiet gate
# sends groups of one (no added wait) and a busy one amortises the round trip, the
# procedure call and the COMMIT's log flush over the whole group. One group in flight
# per process measured cheaper per callback than two (docs/benchmarks-callbacks.md):
# the groups grow larger, and two groups of one process no longer contend for the
# same bucket rows.
GROUP_MAX = 64
GROUPS_IN_FLIGHT_MAX = 1


@dataclass(frozen=True)
class Applied:
    code: EventCode
    outcome: str
    detail: str | None
    status: str | None
    deal_id: int
    waiting: int
    capture: bool


def _created(unix: int | None) -> datetime | None:
    if unix is None:
        return None
    return datetime.fromtimestamp(unix, UTC).replace(tzinfo=None)


def _applied(row: Sequence[Any]) -> Applied:
    return Applied(
        code=EventCode(int(row[0])),
        outcome=str(row[1]),
        detail=row[2],
        status=row[3],
        deal_id=int(row[4] or 0),
        waiting=int(row[5] or 0),
        capture=bool(int(row[6] or 0)),
    )


DUPLICATE = Applied(EventCode.DUPLICATE, "duplicate", None, None, 0, 0, False)


def _group_item(event: ProviderEvent, tx_id: str) -> dict[str, Any]:
    """One event as gate_payment_event_group reads it; absent keys are NULL there."""
    item: dict[str, Any] = {
        "id": event.event_id,
        "type": event.type,
        # Text, as for the one-event call (aiomysql cannot escape bytes).
        "payload": event.payload.decode("utf-8", errors="replace"),
        "tx": tx_id,
    }
    for key, value in (
        ("order", event.order_id),
        ("payment", event.payment_id),
        ("amount", event.amount),
        ("currency", event.currency),
        ("refund", event.refund_id),
    ):
        if value is not None:
            item[key] = value
    created = _created(event.created)
    if created is not None:
        item["created"] = created.strftime("%Y-%m-%d %H:%M:%S")
    return item


class PaymentMachine:
    def __init__(self, db: Database, mirror: Mirror, actor: str) -> None:
        self.db = db
        self.mirror = mirror
        self.actor = actor

    async def record(self, provider: str, event: ProviderEvent, mode: int = 0) -> Applied:
        """Record and apply one event in the database (no follow-ups)."""
        args = (
            mode,
            provider,
            event.event_id,
            event.type,
            event.order_id,
            event.payment_id,
            event.amount,
            event.currency,
            event.refund_id,
            # aiomysql cannot escape bytes with PyMySQL 1.2 (DESIGN's known trap).
            event.payload.decode("utf-8", errors="replace"),
            _created(event.created),
            new_id(),
            self.actor,
        )

        async def attempt() -> tuple[Any, ...] | None:
            async with self.db.connection() as conn:
                return await self.db.call(
                    conn,
                    store.PAYMENT_EVENT,
                    args,
                )

        row = await self.db.retrying(attempt)
        assert row is not None, "gate_payment_event returned no row"
        applied = _applied(row)
        self._note(provider, event, applied)
        return applied

    async def record_group(self, provider: str, events: Sequence[ProviderEvent]) -> list[Applied]:
        """Record and apply new events in one transaction (gate_payment_event_group);
        results in the order given. Raises what the database raised: the whole group
        rolled back, and the caller may run its events one at a time."""
        items = [_group_item(e, new_id()) for e in events]
        payload = orjson.dumps(items).decode()

        async def attempt() -> tuple[Any, ...] | None:
            async with self.db.connection() as conn:
                return await self.db.call(
                    conn,
                    store.PAYMENT_EVENT_GROUP,
                    (provider, payload, self.actor),
                )

        row = await self.db.retrying(attempt)
        assert row is not None, "gate_payment_event_group returned no row"
        results = [_applied(r) for r in orjson.loads(row[0])]
        if len(results) != len(events):
            raise RuntimeError("gate_payment_event_group answered for another group")
        for event, applied in zip(events, results, strict=True):
            self._note(provider, event, applied)
        return results

    def _note(self, provider: str, event: ProviderEvent, applied: Applied) -> None:
        if applied.code == EventCode.QUARANTINED:
            QUARANTINED.inc()
            log.warning(
                "payment event quarantined",
                extra={
                    "provider": provider,
                    "event_id": event.event_id,
                    "event_type": event.type,
                    "order_id": event.order_id,
                    "payment_id": event.payment_id,
                    "detail": applied.detail,
                },
            )

    async def apply(self, provider: str, event: ProviderEvent) -> Applied:
        """Record, apply and follow up one event."""
        applied = await self.record(provider, event)
        await self.follow_up(provider, event.order_id, event.event_id, applied)
        return applied

    async def follow_up(
        self, provider: str, order_id: str | None, event_id: str, applied: Applied
    ) -> None:
        waiting = applied.waiting
        if applied.code == EventCode.LATE:
            await settle_late(self.db, self.mirror, provider, event_id, self.actor)
            waiting = 1  # the settlement may have unblocked a waiting refund
        if waiting and order_id is not None:
            await self.reprocess_waiting(provider, order_id)

    async def reprocess_waiting(self, provider: str, order_id: str) -> int:
        rows = await store.waiting_events(self.db, order_id, provider, WAITING_BATCH_MAX)
        done = 0
        for event_id, event_type, payment_id, amount, currency, refund_id, payload in rows:
            event = ProviderEvent(
                event_id=str(event_id),
                type=str(event_type),
                created=None,
                order_id=order_id,
                payment_id=payment_id,
                amount=None if amount is None else int(amount),
                currency=currency,
                refund_id=refund_id,
                payload=str(payload).encode(),
            )
            applied = await self.record(provider, event, mode=1)
            if applied.code != EventCode.WAITING:
                done += 1
        return done


class GroupCommitter:
    """Gathers the callbacks of one process into groups for gate_payment_event_group.

    `submit` returns the event's own result, as `PaymentMachine.record` would. Nothing
    waits for a timer: a callback that finds fewer than GROUPS_IN_FLIGHT_MAX groups in
    the database starts one at once; the others join the next group, which starts as
    soon as one in flight ends. A redelivery of an event already waiting or in flight
    in this process rides on it and is answered as a duplicate once it committed (the
    database would only find its key). A group that fails for a reason other than a
    retryable conflict (retried inside record_group) is run again one event at a time,
    so one bad event fails only its own callback.
    """

    def __init__(
        self,
        machine: PaymentMachine,
        provider: str,
        group_max: int = GROUP_MAX,
        in_flight_max: int = GROUPS_IN_FLIGHT_MAX,
    ) -> None:
        self.machine = machine
        self.provider = provider
        self.group_max = max(1, group_max)
        self.in_flight_max = max(1, in_flight_max)
        self._queue: list[tuple[ProviderEvent, asyncio.Future[Applied]]] = []
        self._pending: dict[str, asyncio.Future[Applied]] = {}
        # With traces on: each queued callback's trace, for its group's span.
        self._traces: dict[str, Any] = {}
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, event: ProviderEvent) -> Applied:
        first = self._pending.get(event.event_id)
        if first is not None:
            await asyncio.shield(first)
            return DUPLICATE
        future: asyncio.Future[Applied] = asyncio.get_running_loop().create_future()
        self._pending[event.event_id] = future
        if tracing.ENABLED:
            self._traces[event.event_id] = tracing.current()
        self._queue.append((event, future))
        self._start()
        # Shielded: a client that hangs up does not cancel the group's other callbacks.
        return await asyncio.shield(future)

    def _start(self) -> None:
        while self._queue and self._in_flight < self.in_flight_max:
            group = self._queue[: self.group_max]
            del self._queue[: self.group_max]
            self._in_flight += 1
            task = asyncio.create_task(self._run(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, group: list[tuple[ProviderEvent, asyncio.Future[Applied]]]) -> None:
        # Traced: the group's CALL is one span, linked to and from each traced callback.
        with tracing.serving(self._traces.pop(event.event_id, None) for event, _ in group):
            await self._record(group)

    async def _record(self, group: list[tuple[ProviderEvent, asyncio.Future[Applied]]]) -> None:
        try:
            events = [event for event, _ in group]
            try:
                if len(group) == 1:
                    results = [await self.machine.record(self.provider, events[0])]
                else:
                    results = await self.machine.record_group(self.provider, events)
            except Exception as exc:
                # Whatever failed the group (a conflict, a lost connection, one event
                # the procedure could not take), each event is recorded on its own:
                # event ids make a re-run safe, and one bad event fails only itself.
                if len(group) == 1:
                    raise
                log.info("callback group of %d failed (%r); one at a time", len(group), exc)
                await self._one_by_one(group)
                return
            for (_, future), applied in zip(group, results, strict=True):
                if not future.done():
                    future.set_result(applied)
        except BaseException as exc:
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            for event, _ in group:
                self._pending.pop(event.event_id, None)
            self._in_flight -= 1
            self._start()

    async def _one_by_one(self, group: list[tuple[ProviderEvent, asyncio.Future[Applied]]]) -> None:
        for event, future in group:
            try:
                future.set_result(await self.machine.record(self.provider, event))
            except Exception as exc:
                future.set_exception(exc)
