"""The orders a reconciliation pass asks a provider about, when the provider has no
listing API (Alipay, WeChat Pay: per-order queries).

    reconcile ──provider.transactions(cursor, limit, since)──> adapter
        adapter ──window.orders(provider, since, cursor, limit)──> payment_sessions
        (this provider's sessions created since `since`, in order id order, from
        `cursor`) ──> one query per order at the provider

Order ids are ULIDs, so order id order is creation order; the cursor is the last
order id of the previous page. Bounded by `limit` per page (the reconciler's page
size) and by the reconciler's page budget.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gate.payments import store
from gate.store.db import Database


class OrderWindow(Protocol):
    async def orders(
        self, provider: str, since: int, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]: ...


class SessionOrders:
    """The gate's sessions with a provider as the window of orders to query."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def orders(
        self, provider: str, since: int, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        rows = await store.session_orders(self.db, provider, int(since), cursor or "", int(limit))
        orders = [str(r[0]) for r in rows]
        return orders, (orders[-1] if len(orders) == int(limit) else None)


@runtime_checkable
class QueriesPerOrder(Protocol):
    """A provider whose `transactions` needs the window of orders to query."""

    window: OrderWindow | None


def attach_order_window(provider: object, db: Database) -> None:
    """Give a per-order provider the gate's sessions as its window (once)."""
    if isinstance(provider, QueriesPerOrder) and provider.window is None:
        provider.window = SessionOrders(db)
