"""Inventory's statements, one function each (the modules below call them).

    orders.py         order_by_id, order_by_key, RELEASE (run by Database.call)
    unknown_deals.py  highest_deal_id
    janitor.py        order_allocs, ledgered_ops, live_threads
    advice.py         LOCK_WAITERS (sampled on one cursor), deal_buckets,
                      deal_stock, recent_orders

gate/inventory/deals.py still holds its own statements (the SQL home test's list).
A function taking the Database runs its one statement on a connection of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gate.store.db import Database

Row = tuple[Any, ...]

# -- orders --------------------------------------------------------------------------------

# An order row's columns, in the order orders.Order.from_row reads them.
ORDER_COLUMNS = (
    "id, deal_id, user_id, quantity, unit_price, amount, currency, title, status, alloc,"
    " request_fingerprint, expires_at, created_at, updated_at, paid_at, closed_at,"
    " capture_mode, provider, provider_session_id, idempotency_key"
)
# Moves a holding order on and gives its stock back (db/routines/).
RELEASE = "CALL gate_release(%s, %s, %s, %s, %s, %s, %s, %s)"


async def order_by_id(db: Database, order_id: str) -> Row | None:
    return await db.fetchone(f"SELECT {ORDER_COLUMNS} FROM orders WHERE id = %s", (order_id,))


async def order_by_key(db: Database, user_id: int, key: str) -> Row | None:
    return await db.fetchone(
        f"SELECT {ORDER_COLUMNS} FROM orders WHERE user_id = %s AND idempotency_key = %s",
        (user_id, key),
    )


# -- the unknown-deal ceiling ---------------------------------------------------------------


async def highest_deal_id(db: Database) -> Row | None:
    return await db.fetchone("SELECT COALESCE(MAX(id), 0) FROM deals")


# -- the janitor -----------------------------------------------------------------------------


async def order_allocs(db: Database, tokens: Sequence[str]) -> list[Row]:
    marks = ",".join(["%s"] * len(tokens))
    return await db.fetchall(f"SELECT id, alloc FROM orders WHERE id IN ({marks})", tuple(tokens))


async def ledgered_ops(db: Database, tokens: Sequence[str]) -> list[Row]:
    marks = ",".join(["%s"] * len(tokens))
    return await db.fetchall(
        f"SELECT DISTINCT op_id FROM inventory_ledger WHERE op_id IN ({marks})",
        tuple(tokens),
    )


async def live_threads(db: Database, thread_ids: Sequence[int]) -> list[Row]:
    """Those of the server threads still running."""
    marks = ",".join(["%s"] * len(thread_ids))
    return await db.fetchall(
        f"SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN ({marks})",
        tuple(thread_ids),
    )


# -- advice ---------------------------------------------------------------------------------

# Transactions waiting for a lock on one deal's bucket rows (argument: "ID, %").
LOCK_WAITERS = (
    "SELECT COUNT(*), COALESCE(MAX(TIMESTAMPDIFF(MICROSECOND, t.trx_wait_started, NOW(6))), 0)"
    " FROM information_schema.INNODB_TRX AS t JOIN information_schema.INNODB_LOCKS AS l"
    " ON l.lock_id = t.trx_requested_lock_id"
    " WHERE t.trx_state = 'LOCK WAIT'"
    " AND l.lock_table = CONCAT('`', DATABASE(), '`.`deal_buckets`')"
    " AND l.lock_data LIKE %s"
)


async def deal_buckets(db: Database, deal_id: int) -> Row | None:
    return await db.fetchone("SELECT bucket_count FROM deals WHERE id = %s", (deal_id,))


async def deal_stock(db: Database, deal_id: int) -> Row | None:
    """(available, total) over the deal's current layout."""
    return await db.fetchone(
        "SELECT COALESCE(SUM(b.available), 0), COALESCE(SUM(b.total), 0) FROM deal_buckets b"
        " JOIN deals d ON d.id = b.deal_id AND d.layout_epoch = b.epoch WHERE b.deal_id = %s",
        (deal_id,),
    )


async def recent_orders(db: Database, deal_id: int, window_seconds: float) -> Row | None:
    """(orders, distinct commit times) of the deal in the last window_seconds."""
    return await db.fetchone(
        "SELECT COUNT(*), COUNT(DISTINCT created_at) FROM orders"
        " WHERE deal_id = %s AND created_at >= NOW(6) - INTERVAL %s SECOND",
        (deal_id, window_seconds),
    )
