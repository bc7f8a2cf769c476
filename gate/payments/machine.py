"""The order/payment state machine: one provider fact in, one short transaction.

`apply` records the event and applies it (gate_payment_event, one round trip),
then runs what the procedure handed back: a late payment's settlement (it needs a
Redis intent before its transaction), and the events of the same order that were
waiting for this one. Everything here is idempotent: the event's primary key makes
a second delivery a no-op, and every follow-up re-checks state under a row lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gate.db import Database
from gate.mirror import Mirror
from gate.orders import new_id
from gate.payments.codes import EventCode
from gate.payments.late import settle_late
from gate.payments.metrics import QUARANTINED
from gate.payments.provider import ProviderEvent

log = logging.getLogger("gate.payments")

WAITING_BATCH_MAX = 20


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
                    "CALL gate_payment_event(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    args,
                )

        row = await self.db.retrying(attempt)
        assert row is not None, "gate_payment_event returned no row"
        applied = Applied(
            code=EventCode(int(row[0])),
            outcome=str(row[1]),
            detail=row[2],
            status=row[3],
            deal_id=int(row[4] or 0),
            waiting=int(row[5] or 0),
            capture=bool(row[6]),
        )
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
        return applied

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
        rows = await self.db.fetchall(
            "SELECT event_id, event_type, payment_id, amount, currency, refund_id, payload"
            " FROM payment_events WHERE order_id = %s AND provider = %s AND outcome = 'waiting'"
            " ORDER BY received_at LIMIT %s",
            (order_id, provider, WAITING_BATCH_MAX),
        )
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
