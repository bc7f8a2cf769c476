"""Payments' statements: every SQL the payments area runs, one function each.

    sessions.py   PaymentSessions ──> order_and_session, store_session, link_session
    window.py     SessionOrders ──> session_orders
    machine.py    PaymentMachine ──> PAYMENT_EVENT / PAYMENT_EVENT_GROUP (run by
                  Database.call on a connection of its own), waiting_events
    outbox.py     OutboxPublisher ──> begin, lock_unpublished, mark_published, commit
                  (one transaction on the publisher's cursor, around the Redis
                  publish), unpublished_count
    workers.py    PaymentWorker ──> refund_backlog, late_events, waiting_orders,
                  due_refunds / claim_refund / refund_error / refund_submitted,
                  due_authorizations / claim_capture / claim_void / postpone_action /
                  action_error

A function taking the Database runs its one statement on a connection of its own; one
taking a cursor runs inside the caller's transaction on that cursor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gate.store.db import Database

Row = tuple[Any, ...]

# The procedures that record and apply provider events (db/routines/).
PAYMENT_EVENT = "CALL gate_payment_event(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
PAYMENT_EVENT_GROUP = "CALL gate_payment_event_group(%s, %s, %s)"


# -- checkout sessions -------------------------------------------------------------------


async def order_and_session(db: Database, order_id: str) -> Row | None:
    return await db.fetchone(
        "SELECT o.user_id, o.status, o.expires_at > NOW(6), o.amount, o.currency, o.title,"
        " o.capture_mode, UNIX_TIMESTAMP(o.expires_at), o.expires_at,"
        " s.provider, s.session_id, s.redirect_url, s.expires_at"
        " FROM orders o LEFT JOIN payment_sessions s ON s.order_id = o.id WHERE o.id = %s",
        (order_id,),
    )


async def store_session(
    db: Database, order_id: str, provider: str, session_id: str, url: str, expires_at: int
) -> int:
    """1 row when this call stored it, 0 when a concurrent call was first."""
    return await db.execute(
        "INSERT INTO payment_sessions (order_id, provider, session_id, redirect_url,"
        " expires_at) VALUES (%s, %s, %s, %s, FROM_UNIXTIME(%s))"
        " ON DUPLICATE KEY UPDATE order_id = order_id",
        (order_id, provider, session_id, url, expires_at),
    )


async def link_session(db: Database, provider: str, session_id: str, order_id: str) -> None:
    await db.execute(
        "UPDATE orders SET provider = %s, provider_session_id = %s"
        " WHERE id = %s AND provider_session_id IS NULL",
        (provider, session_id, order_id),
    )


async def session_orders(
    db: Database, provider: str, since: int, cursor: str, limit: int
) -> list[Row]:
    return await db.fetchall(
        "SELECT order_id FROM payment_sessions WHERE provider = %s"
        " AND created_at >= FROM_UNIXTIME(%s) AND order_id > %s"
        " ORDER BY order_id LIMIT %s",
        (provider, since, cursor, limit),
    )


# -- the event machine -------------------------------------------------------------------


async def waiting_events(db: Database, order_id: str, provider: str, limit: int) -> list[Row]:
    return await db.fetchall(
        "SELECT event_id, event_type, payment_id, amount, currency, refund_id, payload"
        " FROM payment_events WHERE order_id = %s AND provider = %s AND outcome = 'waiting'"
        " ORDER BY received_at LIMIT %s",
        (order_id, provider, limit),
    )


# -- the outbox (one transaction on the publisher's cursor) ------------------------------


async def begin(cur: Any) -> None:
    await cur.execute("START TRANSACTION")


async def commit(cur: Any) -> None:
    await cur.execute("COMMIT")


async def lock_unpublished(cur: Any, batch_max: int) -> list[Row]:
    # One JSON text column per row: the client parses rows in Python, and seven
    # typed columns (a datetime among them) cost it several times as much.
    await cur.execute(
        "SELECT JSON_ARRAY(id, event_id, topic, aggregate_id, payload,"
        " DATE_FORMAT(created_at, '%%Y-%%m-%%dT%%H:%%i:%%s.%%fZ'),"
        " TIMESTAMPDIFF(MICROSECOND, created_at, NOW(6))) FROM outbox"
        " WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
        (batch_max,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def mark_published(cur: Any, ids: list[int]) -> None:
    marks = ",".join(["%s"] * len(ids))
    await cur.execute(f"UPDATE outbox SET published_at = NOW(6) WHERE id IN ({marks})", tuple(ids))


async def unpublished_count(db: Database) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM outbox WHERE published_at IS NULL")
    return int(row[0]) if row else 0


# -- the payment worker ------------------------------------------------------------------


async def refund_backlog(db: Database) -> int:
    row = await db.fetchone(
        "SELECT COUNT(*) FROM payment_refunds WHERE status IN ('pending', 'submitted')"
    )
    return int(row[0]) if row else 0


async def late_events(db: Database, provider: str, after: float, batch: int) -> list[Row]:
    return await db.fetchall(
        "SELECT event_id, order_id FROM payment_events WHERE outcome = 'late'"
        " AND provider = %s AND received_at < NOW(6) - INTERVAL %s SECOND"
        " ORDER BY received_at LIMIT %s",
        (provider, after, batch),
    )


async def waiting_orders(db: Database, provider: str, after: float, batch: int) -> list[Row]:
    return await db.fetchall(
        "SELECT DISTINCT e.order_id FROM payment_events e"
        " JOIN payments p ON p.provider = e.provider AND p.payment_id = e.payment_id"
        " JOIN orders o ON o.id = e.order_id"
        " WHERE e.outcome = 'waiting' AND e.provider = %s AND p.status = 'succeeded'"
        " AND o.status NOT IN ('EXPIRED', 'CANCELLED')"
        " AND e.received_at < NOW(6) - INTERVAL %s SECOND LIMIT %s",
        (provider, after, batch),
    )


async def due_refunds(db: Database, provider: str, batch: int) -> list[Row]:
    return await db.fetchall(
        "SELECT id, payment_id, amount, generation, attempts FROM payment_refunds"
        " WHERE provider = %s AND status IN ('pending', 'submitted')"
        " AND next_attempt_at <= NOW(6) ORDER BY next_attempt_at LIMIT %s",
        (provider, batch),
    )


async def claim_refund(db: Database, lease: float, row_id: Any, generation: Any) -> int:
    return await db.execute(
        "UPDATE payment_refunds SET attempts = attempts + 1, updated_at = NOW(6),"
        " next_attempt_at = NOW(6) + INTERVAL %s SECOND"
        " WHERE id = %s AND generation = %s AND status IN ('pending', 'submitted')"
        " AND next_attempt_at <= NOW(6)",
        (lease, row_id, generation),
    )


async def refund_error(db: Database, error: str, row_id: Any) -> None:
    await db.execute("UPDATE payment_refunds SET last_error = %s WHERE id = %s", (error, row_id))


async def refund_submitted(db: Database, refund_id: str, row_id: Any, generation: Any) -> None:
    await db.execute(
        "UPDATE payment_refunds SET provider_refund_id = %s, status = 'submitted',"
        " last_error = NULL WHERE id = %s AND generation = %s AND status = 'pending'",
        (refund_id, row_id, generation),
    )


async def due_authorizations(db: Database, provider: str, batch: int) -> list[Row]:
    return await db.fetchall(
        "SELECT p.payment_id, p.amount, p.action_attempts, o.status, o.provider_payment_id"
        " FROM payments p JOIN orders o ON o.id = p.order_id"
        " WHERE p.provider = %s AND p.status = 'authorized' AND p.next_action_at <= NOW(6)"
        " ORDER BY p.next_action_at LIMIT %s",
        (provider, batch),
    )


async def claim_capture(
    db: Database, lease: float, provider: str, payment_id: str, margin: float
) -> int:
    return await db.execute(
        "UPDATE payments p JOIN orders o ON o.id = p.order_id"
        " SET p.action_attempts = p.action_attempts + 1,"
        " p.next_action_at = NOW(6) + INTERVAL %s SECOND, p.updated_at = NOW(6)"
        " WHERE p.provider = %s AND p.payment_id = %s AND p.status = 'authorized'"
        " AND p.next_action_at <= NOW(6) AND o.status = 'AUTHORIZED'"
        " AND o.provider_payment_id = p.payment_id"
        " AND o.expires_at > NOW(6) + INTERVAL %s SECOND",
        (lease, provider, payment_id, margin),
    )


async def claim_void(db: Database, lease: float, provider: str, payment_id: str) -> int:
    return await db.execute(
        "UPDATE payments SET action_attempts = action_attempts + 1,"
        " next_action_at = NOW(6) + INTERVAL %s SECOND, updated_at = NOW(6)"
        " WHERE provider = %s AND payment_id = %s AND status = 'authorized'"
        " AND next_action_at <= NOW(6)",
        (lease, provider, payment_id),
    )


async def postpone_action(db: Database, provider: str, payment_id: str) -> None:
    await db.execute(
        "UPDATE payments SET next_action_at = NOW(6) + INTERVAL 1 SECOND"
        " WHERE provider = %s AND payment_id = %s AND status = 'authorized'",
        (provider, payment_id),
    )


async def action_error(db: Database, error: str, provider: str, payment_id: str) -> None:
    await db.execute(
        "UPDATE payments SET last_error = %s WHERE provider = %s AND payment_id = %s",
        (error, provider, payment_id),
    )


# -- a late payment's settlement (one transaction on late.py's cursor) -------------------


async def rollback(cur: Any) -> None:
    await cur.execute("ROLLBACK")


async def lock_event(cur: Any, provider: str, event_id: str) -> Row | None:
    await cur.execute(
        "SELECT outcome, order_id, payment_id, amount, currency FROM payment_events"
        " WHERE provider = %s AND event_id = %s FOR UPDATE",
        (provider, event_id),
    )
    row: Row | None = await cur.fetchone()
    return row


async def lock_order(cur: Any, order_id: str) -> Row | None:
    await cur.execute(
        "SELECT status, deal_id, user_id, quantity, alloc FROM orders WHERE id = %s FOR UPDATE",
        (order_id,),
    )
    row: Row | None = await cur.fetchone()
    return row


async def db_now(cur: Any) -> Any:
    """The database's clock, read inside the transaction."""
    await cur.execute("SELECT NOW(6)")
    row = await cur.fetchone()
    assert row is not None
    return row[0]


async def add_paid(cur: Any, amount: int, now: Any, order_id: str) -> None:
    await cur.execute(
        "UPDATE orders SET paid_amount = paid_amount + %s, updated_at = %s,"
        " version = version + 1 WHERE id = %s",
        (amount, now, order_id),
    )


async def lock_deal_layout(cur: Any, deal_id: int) -> Row | None:
    await cur.execute(
        "SELECT bucket_count, layout_epoch, per_user_limit FROM deals WHERE id = %s FOR UPDATE",
        (deal_id,),
    )
    row: Row | None = await cur.fetchone()
    return row


async def lock_quota(cur: Any, deal_id: int, user_id: int) -> Row | None:
    await cur.execute(
        "SELECT units FROM user_quota WHERE deal_id = %s AND user_id = %s FOR UPDATE",
        (deal_id, user_id),
    )
    row: Row | None = await cur.fetchone()
    return row


async def lock_buckets(cur: Any, deal_id: int, epoch: int) -> list[Row]:
    await cur.execute(
        "SELECT bucket, available FROM deal_buckets WHERE deal_id = %s AND epoch = %s"
        " ORDER BY bucket FOR UPDATE",
        (deal_id, epoch),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def late_refund_pending(
    cur: Any, amount: int, payment_id: str, now: Any, order_id: str
) -> int:
    await cur.execute(
        "UPDATE orders SET status = 'REFUND_PENDING', paid_amount = paid_amount + %s,"
        " provider_payment_id = %s, paid_at = %s, updated_at = %s,"
        " version = version + 1 WHERE id = %s AND status IN ('EXPIRED', 'CANCELLED')",
        (amount, payment_id, now, now, order_id),
    )
    rowcount: int = cur.rowcount
    return rowcount


async def take_bucket(cur: Any, q: int, now: Any, deal_id: int, bucket: int, epoch: int) -> int:
    await cur.execute(
        "UPDATE deal_buckets SET available = available - %s, sold = sold + %s,"
        " updated_at = %s WHERE deal_id = %s AND bucket = %s AND epoch = %s"
        " AND available >= %s",
        (q, q, now, deal_id, bucket, epoch, q),
    )
    rowcount: int = cur.rowcount
    return rowcount


async def ledger_late_pay(
    cur: Any,
    deal_id: int,
    bucket: int,
    order_id: str,
    op_id: str,
    q: int,
    before: int,
    actor: str,
    now: Any,
) -> None:
    await cur.execute(
        "INSERT INTO inventory_ledger (deal_id, bucket, order_id, op_id, d_total,"
        " d_available, d_held, d_sold, available_before, available_after, reason,"
        " actor, created_at) VALUES (%s, %s, %s, %s, 0, %s, 0, %s, %s, %s,"
        " 'late_pay', %s, %s)",
        (deal_id, bucket, order_id, op_id, -q, q, before, before - q, actor, now),
    )


async def add_quota(cur: Any, deal_id: int, user_id: int, quantity: int) -> None:
    await cur.execute(
        "INSERT INTO user_quota (deal_id, user_id, units) VALUES (%s, %s, %s)"
        " ON DUPLICATE KEY UPDATE units = units + %s",
        (deal_id, user_id, quantity, quantity),
    )


async def late_paid(
    cur: Any, alloc: str, amount: int, payment_id: str, now: Any, order_id: str
) -> int:
    await cur.execute(
        "UPDATE orders SET status = 'PAID', alloc = %s, paid_amount = paid_amount + %s,"
        " provider_payment_id = %s, paid_at = %s, updated_at = %s,"
        " version = version + 1 WHERE id = %s AND status IN ('EXPIRED', 'CANCELLED')",
        (alloc, amount, payment_id, now, now, order_id),
    )
    rowcount: int = cur.rowcount
    return rowcount


async def refund_row(
    cur: Any,
    provider: str,
    payment_id: str,
    order_id: str,
    amount: int,
    currency: str,
    now: Any,
    reason: str,
) -> None:
    await cur.execute(
        "INSERT INTO payment_refunds (provider, payment_id, order_id, amount, currency, reason,"
        " next_attempt_at, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (provider, payment_id, order_id, amount, currency, reason, now, now, now),
    )


async def outbox_row(
    cur: Any, event_id: str, topic: str, aggregate: str, payload: str, now: Any
) -> None:
    await cur.execute(
        "INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at)"
        " VALUES (%s, %s, %s, %s, %s)",
        (event_id, topic, aggregate, payload, now),
    )


async def event_done(cur: Any, provider: str, event_id: str, detail: str, now: Any) -> None:
    await cur.execute(
        "UPDATE payment_events SET outcome = 'applied', detail = %s, processed_at = %s"
        " WHERE provider = %s AND event_id = %s",
        (detail, now, provider, event_id),
    )


# -- reconciliation ----------------------------------------------------------------------


async def try_lock(cur: Any, name: str, wait_seconds: int) -> bool:
    """The pass's named lock, held by the caller's connection."""
    await cur.execute("SELECT GET_LOCK(%s, %s)", (name, wait_seconds))
    row = await cur.fetchone()
    return bool(row and row[0] == 1)


async def release_lock(cur: Any, name: str) -> None:
    await cur.execute("SELECT RELEASE_LOCK(%s)", (name,))


async def payments_of(db: Database, provider: str, payment_ids: Sequence[str]) -> list[Row]:
    marks = ", ".join(["%s"] * len(payment_ids))
    return await db.fetchall(
        f"SELECT payment_id, status, order_id FROM payments"
        f" WHERE provider = %s AND payment_id IN ({marks})",
        (provider, *payment_ids),
    )


async def refunds_of(db: Database, provider: str, payment_ids: Sequence[str]) -> list[Row]:
    marks = ", ".join(["%s"] * len(payment_ids))
    return await db.fetchall(
        f"SELECT payment_id, id, status, provider_refund_id FROM payment_refunds"
        f" WHERE provider = %s AND payment_id IN ({marks})",
        (provider, *payment_ids),
    )


async def events_of(db: Database, provider: str, payment_ids: Sequence[str]) -> list[Row]:
    marks = ", ".join(["%s"] * len(payment_ids))
    return await db.fetchall(
        f"SELECT payment_id, event_type, refund_id, outcome, detail FROM payment_events"
        f" WHERE provider = %s AND payment_id IN ({marks})",
        (provider, *payment_ids),
    )


async def order_status(db: Database, order_id: str) -> Row | None:
    return await db.fetchone("SELECT status FROM orders WHERE id = %s", (order_id,))


async def outbox_has(db: Database, event_id: str) -> bool:
    return bool(await db.fetchone("SELECT 1 FROM outbox WHERE event_id = %s", (event_id,)))


async def flag_row(db: Database, event_id: str, topic: str, aggregate: str, payload: str) -> None:
    await db.execute(
        "INSERT INTO outbox (event_id, topic, aggregate_id, payload, created_at)"
        " VALUES (%s, %s, %s, %s, NOW(6))",
        (event_id, topic, aggregate, payload),
    )


async def refund_reason(db: Database, provider: str, payment_id: str) -> Row | None:
    return await db.fetchone(
        "SELECT reason FROM payment_refunds WHERE provider = %s AND payment_id = %s",
        (provider, payment_id),
    )


async def refunds_due_now(db: Database, provider: str, payment_ids: Sequence[str]) -> None:
    marks = ", ".join(["%s"] * len(payment_ids))
    await db.execute(
        f"UPDATE payment_refunds SET next_attempt_at = NOW(6)"
        f" WHERE provider = %s AND payment_id IN ({marks})"
        f" AND status IN ('pending', 'submitted')",
        (provider, *payment_ids),
    )


async def refund_status(db: Database, provider: str, payment_id: Any) -> Row | None:
    return await db.fetchone(
        "SELECT status FROM payment_refunds WHERE provider = %s AND payment_id = %s",
        (provider, payment_id),
    )


async def paid_in_window(
    db: Database, provider: str, window: float, grace: float, limit: int
) -> list[Row]:
    """Orders PAID through an applied payment.succeeded received in the window."""
    return await db.fetchall(
        "SELECT e.order_id, e.payment_id, o.paid_amount, o.currency FROM payment_events e"
        " JOIN orders o ON o.id = e.order_id"
        " WHERE e.provider = %s AND e.outcome = 'applied'"
        " AND e.event_type = 'payment.succeeded'"
        " AND e.received_at >= NOW(6) - INTERVAL %s SECOND"
        " AND e.received_at <= NOW(6) - INTERVAL %s SECOND"
        " AND o.status = 'PAID' AND o.provider_payment_id = e.payment_id"
        " ORDER BY e.received_at LIMIT %s",
        (provider, window, grace, limit),
    )


async def stuck_refunds(db: Database, provider: str, stuck_seconds: float, limit: int) -> list[Row]:
    return await db.fetchall(
        "SELECT id, payment_id, order_id, amount, currency, generation FROM payment_refunds"
        " WHERE provider = %s AND status IN ('pending', 'submitted')"
        " AND created_at <= NOW(6) - INTERVAL %s SECOND ORDER BY id LIMIT %s",
        (provider, stuck_seconds, limit),
    )


async def refunds_by_id(db: Database, ids: list[int]) -> list[Row]:
    marks = ", ".join(["%s"] * len(ids))
    return await db.fetchall(
        f"SELECT id, status, generation, provider_refund_id, last_error"
        f" FROM payment_refunds WHERE id IN ({marks})",
        ids,
    )


async def duplicate_events(
    db: Database, provider: str, window: float, grace: float, limit: int
) -> list[Row]:
    """Ignored events whose fact another event id of the same payment recorded."""
    return await db.fetchall(
        "SELECT e.order_id, e.payment_id, e.event_type, e.refund_id, e.amount, e.currency"
        " FROM payment_events e"
        " WHERE e.provider = %s AND e.outcome = 'ignored'"
        " AND e.received_at >= NOW(6) - INTERVAL %s SECOND"
        " AND e.received_at <= NOW(6) - INTERVAL %s SECOND"
        " AND e.event_id NOT LIKE 'api:%%'"
        " AND EXISTS (SELECT 1 FROM payment_events d WHERE d.provider = e.provider"
        "   AND d.payment_id = e.payment_id AND d.event_type = e.event_type"
        "   AND d.refund_id <=> e.refund_id AND d.event_id <> e.event_id"
        "   AND d.event_id NOT LIKE 'api:%%')"
        " LIMIT %s",
        (provider, window, grace, limit),
    )
