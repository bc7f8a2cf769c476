"""The waiting room's part of `gate check` (gate/inventory/check.py): its counters balance."""

from __future__ import annotations

from typing import Any

from gate.store.keys import deal_keys
from gate.store.scripts import read_call


async def room_report(client: Any, deal_id: int, available: int | None) -> dict[str, Any]:
    """The room's counters for `gate check`: they must balance (every admission is
    spent, lapsed or unspent), the expiry index must match the admissions, and the
    unspent admissions respect the stock bound at ratio 1 (reported, not a breach:
    a ratio above 1 or a stock removal may pass it)."""
    keys = deal_keys(deal_id)
    # One step: every script changes these counters together.
    (on, admitted, spent, lapsed), unspent, indexed, waiting, tickets = await read_call(
        client,
        "room_state",
        (keys.room, keys.room_admitted, keys.room_expiry, keys.room_queue, keys.room_tickets),
    )
    if on not in ("1", b"1"):
        return {"on": False, "ok": True}
    admitted_n, spent_n, lapsed_n = (int(x or 0) for x in (admitted, spent, lapsed))
    breaches: list[str] = []
    if admitted_n != spent_n + lapsed_n + int(unspent):
        breaches.append(
            f"admitted {admitted_n} != spent {spent_n} + lapsed {lapsed_n} + unspent {unspent}"
        )
    if int(indexed) != int(unspent):
        breaches.append(f"expiry index {indexed} != unspent admissions {unspent}")
    if int(tickets) < int(waiting) + int(unspent):
        breaches.append(f"tickets {tickets} < waiting {waiting} + unspent {unspent}")
    return {
        "on": True,
        "ok": not breaches,
        "breaches": breaches,
        "waiting": int(waiting),
        "tickets": int(tickets),
        "admitted": admitted_n,
        "spent": spent_n,
        "lapsed": lapsed_n,
        "unspent": int(unspent),
        # Stock removed by an admin, or a ratio above 1, may pass this: reported only.
        "within_stock_bound": available is None or int(unspent) <= max(0, available),
    }
