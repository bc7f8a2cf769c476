"""Orders: reading them, their API shapes, and the buyer's cancel."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gate.base.clock import iso
from gate.base.codes import DbCode
from gate.base.errors import Problem, not_found, overloaded

# The reservation path names the id generator `orders.new_id`.
from gate.base.ids import new_id as new_id
from gate.inventory import store
from gate.inventory.mirror import Intent, Mirror
from gate.store.db import Database, DbUnavailable, is_connection_error

log = logging.getLogger("gate.orders")

ORDER_ID_RE = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")


@dataclass(frozen=True)
class Order:
    id: str
    deal_id: int
    user_id: int
    quantity: int
    unit_price: int
    amount: int
    currency: str
    title: str
    status: str
    alloc: str
    fingerprint: str
    expires_at: datetime
    created_at: datetime
    updated_at: datetime
    paid_at: datetime | None
    closed_at: datetime | None
    capture_mode: str
    provider: str | None
    provider_session_id: str | None
    idempotency_key: str

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Order:
        return cls(
            id=str(row[0]),
            deal_id=int(row[1]),
            user_id=int(row[2]),
            quantity=int(row[3]),
            unit_price=int(row[4]),
            amount=int(row[5]),
            currency=str(row[6]),
            title=str(row[7]),
            status=str(row[8]),
            alloc=str(row[9]),
            fingerprint=str(row[10]),
            expires_at=row[11],
            created_at=row[12],
            updated_at=row[13],
            paid_at=row[14],
            closed_at=row[15],
            capture_mode=str(row[16]),
            provider=row[17],
            provider_session_id=row[18],
            idempotency_key=str(row[19]),
        )

    def reservation_body(self) -> dict[str, Any]:
        """The 201 body of the reservation that created this order (replayed as is)."""
        return {
            "order_id": self.id,
            "status": "PENDING_PAYMENT",
            "deal_id": self.deal_id,
            "quantity": self.quantity,
            "unit_price": self.unit_price,
            "amount": self.amount,
            "currency": self.currency,
            "expires_at": iso(self.expires_at),
        }

    def view(self) -> dict[str, Any]:
        return {
            "order_id": self.id,
            "status": self.status,
            "deal_id": self.deal_id,
            "title": self.title,
            "quantity": self.quantity,
            "unit_price": self.unit_price,
            "amount": self.amount,
            "currency": self.currency,
            "capture_mode": self.capture_mode,
            "expires_at": iso(self.expires_at),
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
            "paid_at": iso(self.paid_at),
            "closed_at": iso(self.closed_at),
        }


def valid_order_id(order_id: str) -> bool:
    return bool(ORDER_ID_RE.fullmatch(order_id))


async def get(db: Database, order_id: str) -> Order | None:
    if not valid_order_id(order_id):
        return None
    row = await store.order_by_id(db, order_id)
    return Order.from_row(row) if row else None


async def by_idempotency_key(db: Database, user_id: int, key: str) -> Order | None:
    row = await store.order_by_key(db, user_id, key)
    return Order.from_row(row) if row else None


async def get_for_buyer(db: Database, order_id: str, user_id: int) -> Order:
    """The buyer's own order; another buyer's order is indistinguishable from none."""
    try:
        order = await get(db, order_id)
    except Exception as exc:
        # A connection lost mid-query (killed, a failover) is a 503 too, never a 500.
        if isinstance(exc, DbUnavailable) or is_connection_error(exc):
            raise overloaded("Database unavailable; retry shortly.") from None
        raise
    if order is None or order.user_id != user_id:
        raise not_found("order")
    return order


async def release(
    db: Database,
    mirror: Mirror,
    order: Order,
    *,
    to_status: str,
    user_id: int | None,
    due_only: bool,
    allow_authorized: bool,
    reason: str,
    actor: str,
) -> bool:
    """Move a holding order to `to_status` and give its stock back, in the database
    and then in Redis. False: the order was not (or no longer) releasable."""
    intent = Intent(id=new_id(), user_id=order.user_id, units=-order.quantity, deltas=order.alloc)
    try:
        await mirror.intend(order.deal_id, [intent])
    except Exception as exc:
        # Without the intent Redis cannot be told exactly; the resync loop will
        # bring it back to the database once the release commits.
        log.warning("order %s: release intent not recorded in Redis: %r", order.id, exc)

    async def attempt() -> tuple[Any, ...] | None:
        async with db.connection() as conn:
            return await db.call(
                conn,
                store.RELEASE,
                (
                    order.id,
                    to_status,
                    user_id,
                    int(due_only),
                    int(allow_authorized),
                    reason,
                    actor,
                    intent.id,
                ),
            )

    row = await db.retrying(attempt)
    assert row is not None, "gate_release returned no row"
    released = DbCode(int(row[0])) == DbCode.OK
    try:
        await mirror.apply(order.deal_id, [(intent.id, released)])
    except Exception as exc:
        # The database holds the truth; the janitor resolves the intent later.
        log.warning("order %s: release not yet applied in Redis: %r", order.id, exc)
    return released


async def cancel(db: Database, mirror: Mirror, order_id: str, user_id: int) -> Order:
    order = await get_for_buyer(db, order_id, user_id)
    try:
        released = await release(
            db,
            mirror,
            order,
            to_status="CANCELLED",
            user_id=user_id,
            due_only=False,
            allow_authorized=False,
            reason="cancel",
            actor=f"user:{user_id}",
        )
    except Exception as exc:
        if isinstance(exc, DbUnavailable) or is_connection_error(exc):
            raise overloaded("Database unavailable; retry shortly.") from None
        raise
    after = await get(db, order_id)
    assert after is not None, "an order never disappears"
    if not released:
        raise Problem(
            "CONFLICT",
            f"Order is {after.status}; only a PENDING_PAYMENT order can be cancelled.",
            extra={"order_status": after.status},
        )
    return after
