"""Queue mode's statements: every SQL the area runs, one function each.

    __init__.py      admin_set_mode ──> deal_partitions, set_mode
    service.py       ModeCache ──> deal_mode, mode_snapshot; prices ──> deal_price
    consumer.py      committed_orders, RESERVE_GROUP / RESERVE_ONE (through
                     gate/reserve/groups.py reservation_call), dead_letter,
                     rejection_outbox
    cli.py           deal_modes, dead_letter_counts, dead_letters, dead_letter_request,
                     claim / claim_time / release / record_* / why_taken
    console_panel.py panel_rows, deal_exists, waiting_dead_letters

Each function takes the gate's Database (gate/store/db.py) and runs one statement on
a connection of its own: none of these statements shares a transaction with another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gate.store.db import Database

Row = tuple[Any, ...]

# The procedures a consumer commits through (gate/reserve/groups.py reservation_call
# runs them under the consumer's lease).
RESERVE_GROUP = "CALL gate_reserve_group(%s, %s)"
RESERVE_ONE = "CALL gate_reserve(%s, %s, %s, %s, %s, %s, %s, %s)"

# A dead letter waits for a retry until one has an outcome; a claim with none older
# than the CLI's takeover age was made by a retry that died (gate/queuemode/cli.py).
_WAITING = (
    "(retried_at IS NULL OR (retried_outcome IS NULL AND retried_order_id IS NULL"
    " AND retried_at < NOW(6) - INTERVAL %s SECOND))"
)


def _marks(n: int) -> str:
    return ",".join(["%s"] * n)


# -- deals.mode (the admin endpoint, ModeCache) ---------------------------------------


async def deal_partitions(db: Database, deal_id: int) -> Row | None:
    return await db.fetchone("SELECT partitions FROM deals WHERE id = %s", (deal_id,))


async def set_mode(db: Database, deal_id: int, mode: str) -> None:
    await db.execute("UPDATE deals SET mode = %s WHERE id = %s", (mode, deal_id))


async def deal_mode(db: Database, deal_id: int) -> Row | None:
    return await db.fetchone("SELECT mode FROM deals WHERE id = %s", (deal_id,))


async def mode_snapshot(db: Database, limit: int) -> list[Row]:
    """Rows (0, highest deal id) and (1, id) per deal in queue mode, in one statement
    so one read view."""
    return await db.fetchall(
        "SELECT 0, COALESCE(MAX(id), 0) FROM deals"
        " UNION ALL (SELECT 1, id FROM deals WHERE mode = 'queue' ORDER BY id LIMIT %s)",
        (limit,),
    )


async def deal_price(db: Database, deal_id: int) -> Row | None:
    return await db.fetchone("SELECT unit_price, currency FROM deals WHERE id = %s", (deal_id,))


async def deal_modes(db: Database, deal_ids: list[int]) -> list[Row]:
    return await db.fetchall(
        f"SELECT id, mode FROM deals WHERE id IN ({_marks(len(deal_ids))})", deal_ids
    )


# -- the consumer ----------------------------------------------------------------------


async def committed_orders(db: Database, tokens: tuple[str, ...]) -> list[Row]:
    return await db.fetchall(
        f"SELECT id, alloc FROM orders WHERE id IN ({_marks(len(tokens))})", tokens
    )


async def dead_letter(db: Database, args: tuple[Any, ...]) -> None:
    """args: order_id, deal_id, user_id, quantity, idempotency_key, attempts,
    last_error."""
    await db.execute(
        "INSERT IGNORE INTO queue_dead_letters (order_id, deal_id, user_id, quantity,"
        " idempotency_key, attempts, last_error) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        args,
    )


async def rejection_outbox(
    db: Database, token: str, deal_id: int, user_id: int, quantity: int, reason: str
) -> None:
    """The rejected order's `order.rejected` outbox row, written once (its event id
    is the order id)."""
    await db.execute(
        "INSERT IGNORE INTO outbox (event_id, topic, aggregate_id, payload, created_at)"
        " SELECT %s, 'order.rejected', %s, JSON_OBJECT('order_id', %s, 'deal_id', %s + 0,"
        " 'user_id', %s + 0, 'quantity', %s + 0, 'status', 'REJECTED', 'reason', %s,"
        " 'order_amount', d.unit_price * %s, 'order_currency', d.currency,"
        " 'at', DATE_FORMAT(NOW(6), '%%Y-%%m-%%dT%%H:%%i:%%s.%%fZ')), NOW(6)"
        " FROM (SELECT 1) AS one LEFT JOIN deals d ON d.id = %s",
        (token, token, token, deal_id, user_id, quantity, reason, quantity, deal_id),
    )


# -- dead letters (gate queue …, the console panel) -------------------------------------


async def dead_letter_counts(db: Database, deal_ids: list[int]) -> list[Row]:
    return await db.fetchall(
        "SELECT deal_id, COUNT(*) FROM queue_dead_letters"
        f" WHERE deal_id IN ({_marks(len(deal_ids))}) GROUP BY deal_id",
        deal_ids,
    )


async def dead_letters(db: Database, deal: int | None, limit: int) -> list[Row]:
    sql = (
        "SELECT id, order_id, deal_id, user_id, quantity, attempts, last_error, created_at,"
        " retried_order_id, retried_outcome, retried_at FROM queue_dead_letters"
    )
    args: tuple[Any, ...] = ()
    if deal is not None:
        sql += " WHERE deal_id = %s"
        args = (deal,)
    sql += " ORDER BY id DESC LIMIT %s"
    return await db.fetchall(sql, (*args, limit))


async def dead_letter_request(db: Database, entry_id: int) -> Row | None:
    return await db.fetchone(
        "SELECT deal_id, user_id, quantity, idempotency_key FROM queue_dead_letters WHERE id = %s",
        (entry_id,),
    )


async def claim(db: Database, entry_id: int, takeover_seconds: int) -> int:
    """Rows claimed (0 or 1): one claim at a time; a claim stays once the retry has an
    outcome, and one with none is taken over after takeover_seconds."""
    return await db.execute(
        "UPDATE queue_dead_letters SET retried_at = NOW(6) WHERE id = %s AND (retried_at IS NULL"
        " OR (retried_outcome IS NULL AND retried_order_id IS NULL"
        " AND retried_at < NOW(6) - INTERVAL %s SECOND))",
        (entry_id, takeover_seconds),
    )


async def claim_time(db: Database, entry_id: int) -> Any:
    mine = await db.fetchone("SELECT retried_at FROM queue_dead_letters WHERE id = %s", (entry_id,))
    return mine[0] if mine else None


async def _settle(db: Database, sql: str, args: tuple[Any, ...], entry_id: int, at: Any) -> None:
    # Only this command's own claim: one taken over meanwhile is not touched.
    await db.execute(sql + " WHERE id = %s AND retried_at = %s", (*args, entry_id, at))


async def release(db: Database, entry_id: int, at: Any) -> None:
    await _settle(db, "UPDATE queue_dead_letters SET retried_at = NULL", (), entry_id, at)


async def record_refusal(db: Database, entry_id: int, at: Any, code: str) -> None:
    await _settle(db, "UPDATE queue_dead_letters SET retried_outcome = %s", (code,), entry_id, at)


async def record_order(db: Database, entry_id: int, at: Any, order_id: str, status: str) -> None:
    await _settle(
        db,
        "UPDATE queue_dead_letters SET retried_order_id = %s, retried_outcome = %s",
        (order_id, status),
        entry_id,
        at,
    )


async def why_taken(db: Database, entry_id: int) -> Row | None:
    return await db.fetchone(
        "SELECT retried_order_id, retried_outcome, retried_at,"
        " TIMESTAMPDIFF(SECOND, retried_at, NOW(6)) FROM queue_dead_letters WHERE id = %s",
        (entry_id,),
    )


async def panel_rows(db: Database, deal_ids: list[int], takeover_seconds: int) -> list[Row]:
    """Per deal: id, mode, its dead letters, those waiting for a retry."""
    return await db.fetchall(
        # COUNT and SUM over the joined rows only: a deal without dead letters has
        # one row of NULLs, which is no dead letter.
        "SELECT d.id, d.mode, COUNT(l.id), COALESCE(SUM(l.id IS NOT NULL AND " + _WAITING + "), 0)"
        " FROM deals d LEFT JOIN queue_dead_letters l ON l.deal_id = d.id"
        f" WHERE d.id IN ({_marks(len(deal_ids))}) GROUP BY d.id, d.mode",
        (takeover_seconds, *deal_ids),
    )


async def deal_exists(db: Database, deal_id: int) -> bool:
    return await db.fetchone("SELECT 1 FROM deals WHERE id = %s", (deal_id,)) is not None


async def waiting_dead_letters(
    db: Database, deal_id: int, takeover_seconds: int, limit: int
) -> list[Row]:
    return await db.fetchall(
        f"SELECT id FROM queue_dead_letters WHERE deal_id = %s AND {_WAITING} ORDER BY id LIMIT %s",
        (deal_id, takeover_seconds, limit),
    )
