"""Inventory's statements, one function each (the modules below call them).

    orders.py         order_by_id, order_by_key, RELEASE (run by Database.call)
    unknown_deals.py  highest_deal_id
    janitor.py        order_allocs, ledgered_ops, live_threads
    advice.py         LOCK_WAITERS (sampled on one cursor), deal_buckets,
                      deal_stock, recent_orders
    check.py          partitions, all_deal_ids, snapshot_* (one consistent snapshot,
                      on the cursor of Database.snapshot)
    repair.py         repair_* reads, begin / set_counters / set_quotas /
                      repair_ledger_rows / commit (one transaction on its cursor)
    pause.py          pause_row, set_paused / set_resumed (in the caller's
                      transaction, with its ledger row), paused_deal_ids

gate/inventory/deals.py and mirror.py still hold their own statements (the SQL home
test's list).
A function taking the Database runs its one statement on a connection of its own; one
taking a cursor runs inside the caller's transaction or snapshot on that cursor.
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


# -- gate check (one consistent snapshot on check.py's cursor) -------------------------------

# An order's allocation "b:q[,b:q…]" as rows (b, q), by the server: the string made a
# JSON array of pairs.
_PARTS = (
    "JSON_TABLE(CONCAT('[[', REPLACE(REPLACE(o.alloc, ',', '],['), ':', ','), ']]'),"
    " '$[*]' COLUMNS (b INT UNSIGNED PATH '$[0]', q INT UNSIGNED PATH '$[1]')) AS a"
)
_HOLDING = "('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')"


async def partitions(db: Database, deal_id: int) -> Row | None:
    return await db.fetchone("SELECT partitions FROM deals WHERE id = %s", (deal_id,))


async def all_deal_ids(db: Database) -> list[Row]:
    return await db.fetchall("SELECT id FROM deals ORDER BY id")


async def snapshot_deal(cur: Any, deal_id: int) -> Row | None:
    await cur.execute(
        "SELECT bucket_count, layout_epoch, per_user_limit FROM deals WHERE id = %s",
        (deal_id,),
    )
    row: Row | None = await cur.fetchone()
    return row


async def snapshot_buckets(cur: Any, deal_id: int) -> list[Row]:
    await cur.execute(
        "SELECT bucket, epoch, total, available, held, sold FROM deal_buckets"
        " WHERE deal_id = %s ORDER BY bucket",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def snapshot_ledger(cur: Any, deal_id: int) -> list[Row]:
    await cur.execute(
        "SELECT bucket, SUM(d_total), SUM(d_available), SUM(d_held), SUM(d_sold)"
        # The deal's own rows through their index: for a deal with a large share of
        # the table the optimizer picks a full scan, 2.5 times slower here.
        " FROM inventory_ledger FORCE INDEX (ix_ledger_deal) WHERE deal_id = %s"
        " GROUP BY bucket",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def snapshot_order_units(cur: Any, bucket_count: int, deal_id: int) -> list[Row]:
    """(bucket of the current layout, paid, units) summed by the server."""
    await cur.execute(
        f"SELECT MOD(a.b, %s), o.status = 'PAID', SUM(a.q) FROM orders AS o, {_PARTS}"
        f" WHERE o.deal_id = %s AND o.status IN {_HOLDING} GROUP BY 1, 2",
        (bucket_count, deal_id),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def snapshot_order_totals(cur: Any, deal_id: int) -> list[Row]:
    await cur.execute(
        f"SELECT status = 'PAID', COALESCE(SUM(quantity), 0) FROM orders"
        f" WHERE deal_id = %s AND status IN {_HOLDING} GROUP BY 1",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def snapshot_mismatches(cur: Any, deal_id: int, limit: int) -> list[Row]:
    """Orders whose allocation does not add up to their quantity, at most limit."""
    await cur.execute(
        f"SELECT o.alloc, o.quantity FROM orders AS o, {_PARTS}"
        f" WHERE o.deal_id = %s AND o.status IN {_HOLDING}"
        " GROUP BY o.id HAVING COALESCE(SUM(a.q), 0) <> MAX(o.quantity)"
        f" LIMIT {limit}",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def snapshot_quota(cur: Any, deal_id: int) -> int:
    await cur.execute(
        "SELECT COALESCE(SUM(units), 0) FROM user_quota WHERE deal_id = %s", (deal_id,)
    )
    q = await cur.fetchone()
    return int(q[0]) if q else 0


# -- gate repair (one transaction on repair.py's cursor; lock is "" or " FOR UPDATE") ----


async def repair_deal(cur: Any, deal_id: int, lock: str) -> Row | None:
    await cur.execute(
        f"SELECT bucket_count, layout_epoch, per_user_limit FROM deals WHERE id = %s{lock}",
        (deal_id,),
    )
    row: Row | None = await cur.fetchone()
    return row


async def repair_buckets(cur: Any, deal_id: int, lock: str) -> list[Row]:
    await cur.execute(
        "SELECT bucket, epoch, total, available, held, sold FROM deal_buckets"
        f" WHERE deal_id = %s ORDER BY bucket{lock}",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def repair_ledger(cur: Any, deal_id: int) -> list[Row]:
    await cur.execute(
        "SELECT bucket, SUM(d_total), SUM(d_available), SUM(d_held), SUM(d_sold)"
        " FROM inventory_ledger FORCE INDEX (ix_ledger_deal) WHERE deal_id = %s GROUP BY bucket",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def repair_orders(cur: Any, deal_id: int) -> list[Row]:
    """(user_id, quantity, status, alloc) of the deal's holding and paid orders."""
    await cur.execute(
        "SELECT user_id, quantity, status, alloc FROM orders WHERE deal_id = %s AND status IN"
        " ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')",
        (deal_id,),
    )
    rows: list[Row] = await cur.fetchall()
    return rows


async def repair_quota(cur: Any, deal_id: int, lock: str) -> list[Row]:
    await cur.execute(f"SELECT user_id, units FROM user_quota WHERE deal_id = %s{lock}", (deal_id,))
    rows: list[Row] = await cur.fetchall()
    return rows


async def begin(cur: Any) -> None:
    await cur.execute("START TRANSACTION")


async def rollback(cur: Any) -> None:
    await cur.execute("ROLLBACK")


async def commit(cur: Any) -> None:
    await cur.execute("COMMIT")


async def set_counters(cur: Any, counters: Sequence[int], deal_id: int, bucket: int) -> None:
    """counters: (total, available, held, sold)."""
    await cur.execute(
        "UPDATE deal_buckets SET total = %s, available = %s, held = %s, sold = %s,"
        " updated_at = NOW(6) WHERE deal_id = %s AND bucket = %s",
        (*counters, deal_id, bucket),
    )


async def set_quotas(cur: Any, rows: list[tuple[int, int, int]]) -> None:
    """rows: (deal_id, user_id, units)."""
    await cur.executemany(
        "INSERT INTO user_quota (deal_id, user_id, units) VALUES (%s, %s, %s)"
        " ON DUPLICATE KEY UPDATE units = VALUES(units)",
        rows,
    )


async def bucket_zero_available(cur: Any, deal_id: int) -> int:
    await cur.execute(
        "SELECT available FROM deal_buckets WHERE deal_id = %s AND bucket = 0", (deal_id,)
    )
    return int((await cur.fetchone())[0])


async def repair_ledger_rows(cur: Any, rows: list[tuple[Any, ...]]) -> None:
    """rows: (deal_id, bucket, d_total, d_available, d_held, d_sold, available_before,
    available_after, actor, note)."""
    await cur.executemany(
        "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held, d_sold,"
        " available_before, available_after, reason, actor, note)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'repair', %s, %s)",
        rows,
    )


# -- pause ---------------------------------------------------------------------------------


async def pause_row(db: Database, deal_id: int) -> Row | None:
    """(paused_at, pause_reason) of the deal, or None for no such deal."""
    row: Row | None = await db.fetchone(
        "SELECT paused_at, pause_reason FROM deals WHERE id = %s", (deal_id,)
    )
    return row


async def set_paused(cur: Any, deal_id: int, reason: str, seen_at: Any) -> bool:
    """Paused now unless already, or (with `seen_at`) resumed since `seen_at`."""
    await cur.execute(
        "UPDATE deals SET paused_at = NOW(6), pause_reason = %s"
        " WHERE id = %s AND paused_at IS NULL"
        " AND (%s IS NULL OR resumed_at IS NULL OR resumed_at < %s)",
        (reason, deal_id, seen_at, seen_at),
    )
    return bool(cur.rowcount == 1)


async def set_resumed(cur: Any, deal_id: int) -> bool:
    await cur.execute(
        "UPDATE deals SET paused_at = NULL, pause_reason = NULL,"
        " resumed_at = NOW(6) WHERE id = %s AND paused_at IS NOT NULL",
        (deal_id,),
    )
    return bool(cur.rowcount == 1)


async def paused_deal_ids(db: Database, limit: int) -> list[int]:
    rows = await db.fetchall(
        "SELECT id FROM deals WHERE paused_at IS NOT NULL ORDER BY id LIMIT %s", (limit,)
    )
    return [int(r[0]) for r in rows]
