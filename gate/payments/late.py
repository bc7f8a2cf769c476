"""Late payments: money that arrived after the order's hold ended.

If the deal still has the units, they are taken again (ledgered, with a Redis
intent so the mirror follows exactly) and the order is PAID; otherwise the order
becomes REFUND_PENDING with a refund row the refund worker settles through the
provider. Either way the event moves from 'late' to 'applied' in the same
transaction, so two gates settling the same event cannot both act: the event row
is locked first and re-checked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from gate.base.alloc import format_alloc, parse_alloc
from gate.base.codes import OrderStatus
from gate.base.ids import new_id
from gate.inventory.mirror import Intent, Mirror
from gate.payments import store
from gate.store.db import Database, is_connection_error

log = logging.getLogger("gate.payments.late")


@dataclass(frozen=True)
class LateResult:
    outcome: str  # paid | refund_pending | second_payment | noop
    order_id: str | None
    deal_id: int


def plan_retake(
    available: dict[int, int], quantity: int, preferred: list[int]
) -> list[tuple[int, int]] | None:
    """Which buckets give `quantity` units: the order's own buckets first, then the
    fullest. None when the deal has fewer units left."""
    if sum(available.values()) < quantity:
        return None
    order = list(dict.fromkeys(b for b in preferred if b in available))
    order += sorted((b for b in available if b not in order), key=lambda b: -available[b])
    plan: dict[int, int] = {}
    need = quantity
    for b in order:
        if need == 0:
            break
        take = min(need, available[b])
        if take > 0:
            plan[b] = take
            need -= take
    assert need == 0, "availability summed to enough but the plan fell short"
    return sorted(plan.items())


def _payload(**fields: Any) -> str:
    return orjson.dumps(fields).decode()


async def settle_late(
    db: Database, mirror: Mirror, provider: str, event_id: str, actor: str
) -> LateResult:
    """Settle one event recorded as 'late'. Safe to run twice or concurrently."""
    intents: list[tuple[int, Intent]] = []

    async def attempt() -> LateResult:
        async with db.connection() as conn, conn.cursor() as cur:
            await store.begin(cur)
            ev = await store.lock_event(cur, provider, event_id)
            if ev is None or ev[0] != "late":
                await store.rollback(cur)
                return LateResult("noop", None, 0)
            order_id, payment_id, amount, currency = str(ev[1]), str(ev[2]), int(ev[3]), ev[4]
            order = await store.lock_order(cur, order_id)
            assert order is not None, "a late event always names an existing order"
            status, deal_id, user_id, quantity, alloc = (
                str(order[0]),
                int(order[1]),
                int(order[2]),
                int(order[3]),
                str(order[4]),
            )
            now = await store.db_now(cur)
            at = now.isoformat(timespec="microseconds") + "Z"
            tx = new_id()
            common = {
                "order_id": order_id,
                "deal_id": deal_id,
                "user_id": user_id,
                "quantity": quantity,
                "provider": provider,
                "payment_id": payment_id,
                "amount": amount,
                "currency": currency,
                "event_id": event_id,
                "late": True,
                "at": at,
            }

            if status not in (OrderStatus.EXPIRED, OrderStatus.CANCELLED):
                # Another payment settled this order meanwhile: this one goes back.
                await store.add_paid(cur, amount, now, order_id)
                await _refund_row(
                    cur, provider, payment_id, order_id, amount, currency, now, "second_payment"
                )
                await _outbox(
                    cur,
                    tx,
                    "payment.refund_scheduled",
                    order_id,
                    {**common, "status": status, "detail": "second_payment"},
                    now,
                )
                await _event_done(cur, provider, event_id, "second_payment", now)
                await store.commit(cur)
                return LateResult("second_payment", order_id, deal_id)

            deal = await store.lock_deal_layout(cur, deal_id)
            assert deal is not None
            nb, epoch, limit = int(deal[0]), int(deal[1]), deal[2]
            # The per-user limit holds for a re-take as for a reservation (the buyer may
            # have reserved again once this order expired and gave its quota back):
            # over it, the money goes back. Read before the bucket rows, in the order
            # gate_reserve locks them.
            over_limit = False
            if limit is not None:
                quota = await store.lock_quota(cur, deal_id, user_id)
                over_limit = (int(quota[0]) if quota else 0) + quantity > int(limit)
            available = {int(b): int(a) for b, a in await store.lock_buckets(cur, deal_id, epoch)}
            preferred = [b % nb for b, _ in parse_alloc(alloc)]
            plan = None if over_limit else plan_retake(available, quantity, preferred)

            if plan is None:
                why = "late_over_limit" if over_limit else "late_no_stock"
                changed = await store.late_refund_pending(cur, amount, payment_id, now, order_id)
                assert changed == 1, "the order row is locked in this transaction"
                await _refund_row(cur, provider, payment_id, order_id, amount, currency, now, why)
                await _outbox(
                    cur,
                    tx,
                    "order.refund_pending",
                    order_id,
                    {**common, "status": OrderStatus.REFUND_PENDING},
                    now,
                )
                await _event_done(cur, provider, event_id, "late_refund", now)
                await store.commit(cur)
                return LateResult("refund_pending", order_id, deal_id)

            for b, q in plan:
                taken = await store.take_bucket(cur, q, now, deal_id, b, epoch)
                assert taken == 1, "bucket rows are locked in this transaction"
                await store.ledger_late_pay(
                    cur, deal_id, b, order_id, tx, q, available[b], actor, now
                )
            if limit is not None:
                await store.add_quota(cur, deal_id, user_id, quantity)
            changed = await store.late_paid(
                cur, format_alloc(plan), amount, payment_id, now, order_id
            )
            assert changed == 1, "the order row is locked in this transaction"
            await _outbox(
                cur, tx, "order.paid", order_id, {**common, "status": OrderStatus.PAID}, now
            )
            await _event_done(cur, provider, event_id, "late_retake", now)
            # Redis must learn of the change before it can be seen committed; the
            # bucket rows stay locked only for this one short call.
            intent = Intent(tx, user_id, quantity, ",".join(f"{b}:{-q}" for b, q in plan))
            intents.append((deal_id, intent))
            try:
                await mirror.intend(deal_id, [intent])
            except Exception as exc:
                log.warning("order %s: re-take intent not recorded in Redis: %r", order_id, exc)
            await store.commit(cur)
            return LateResult("paid", order_id, deal_id)

    try:
        result = await db.retrying(attempt)
    except Exception as exc:
        # Intents of attempts that rolled back are dropped; when the connection broke
        # the outcome is unknown and the janitor resolves them against the ledger.
        if not is_connection_error(exc):
            for deal_id, intent in intents:
                await _resolve(mirror, deal_id, intent, False)
        raise
    for deal_id, intent in intents[:-1]:
        await _resolve(mirror, deal_id, intent, False)
    if intents:
        deal_id, intent = intents[-1]
        await _resolve(mirror, deal_id, intent, result.outcome == "paid")
    return result


async def _resolve(mirror: Mirror, deal_id: int, intent: Intent, committed: bool) -> None:
    try:
        await mirror.apply(deal_id, [(intent.id, committed)])
    except Exception as exc:
        log.warning("deal %s: re-take not yet applied in Redis: %r", deal_id, exc)


async def _refund_row(
    cur: Any,
    provider: str,
    payment_id: str,
    order_id: str,
    amount: int,
    currency: str,
    now: Any,
    reason: str,
) -> None:
    await store.refund_row(cur, provider, payment_id, order_id, amount, currency, now, reason)


async def _outbox(
    cur: Any, event_id: str, topic: str, aggregate: str, payload: dict[str, Any], now: Any
) -> None:
    await store.outbox_row(cur, event_id, topic, aggregate, _payload(**payload), now)


async def _event_done(cur: Any, provider: str, event_id: str, detail: str, now: Any) -> None:
    await store.event_done(cur, provider, event_id, detail, now)
