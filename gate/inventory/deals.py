"""Deals: creation, buyer and admin views, stock adjustment, rebucketing, ledger.

Every change to stock goes through bucket rows under the same constraints the
reservation path obeys (available never below zero, each row balanced) and is
ledgered row by row; Redis follows after the commit.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from redis.exceptions import RedisError

from gate.base import validate
from gate.base.alloc import parse_alloc
from gate.base.clock import iso
from gate.base.codes import OrderStatus
from gate.base.errors import Problem, invalid, not_found
from gate.base.ids import new_id
from gate.base.singleflight import SingleFlight
from gate.inventory.check import check_deal
from gate.inventory.mirror import Intent, Mirror
from gate.inventory.room_config import parse_room, room_view
from gate.inventory.unknown_deals import UnknownDeals
from gate.store.db import Database
from gate.store.keys import PARTITIONS_MAX, deal_keys

log = logging.getLogger("gate.deals")

CURRENCY_RE = re.compile(r"[A-Z]{3}")
MAX_STOCK = 1_000_000_000
MAX_BUCKETS = 1024
MAX_PRICE = 10**15
LEDGER_PAGE_MAX = 1000
LIST_PAGE_MAX = 1000
MAX_ID = 2**63 - 1
PUBLIC_CACHE_SECONDS = 1.0
PUBLIC_CACHE_MAX = 10_000

_DEAL_COLUMNS = (
    "id, title, unit_price, currency, bucket_count, layout_epoch, hold_seconds,"
    " per_user_limit, max_per_order, capture_mode, starts_at, ends_at, created_at, updated_at,"
    " waiting_room, mode, partitions, paused_at, pause_reason"
)


@dataclass(frozen=True)
class Deal:
    id: int
    title: str
    unit_price: int
    currency: str
    bucket_count: int
    layout_epoch: int
    hold_seconds: int
    per_user_limit: int | None
    max_per_order: int
    capture_mode: str
    starts_at: datetime | None
    ends_at: datetime | None
    created_at: datetime
    updated_at: datetime
    waiting_room: str | None = (
        None  # the room's JSON (gate/inventory/room_config.py), None: no room
    )
    # "sync" or "queue" (docs/queue-mode.md).
    mode: str = "sync"
    # Redis partitions of the deal (docs/scale-out.md, "Deal partitions"), fixed at
    # creation.
    partitions: int = 1
    # The sale paused (gate/inventory/pause.py): since when, and why. None: it sells.
    paused_at: datetime | None = None
    pause_reason: str | None = None

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Deal:
        return cls(
            id=int(row[0]),
            title=str(row[1]),
            unit_price=int(row[2]),
            currency=str(row[3]),
            bucket_count=int(row[4]),
            layout_epoch=int(row[5]),
            hold_seconds=int(row[6]),
            per_user_limit=None if row[7] is None else int(row[7]),
            max_per_order=int(row[8]),
            capture_mode=str(row[9]),
            starts_at=row[10],
            ends_at=row[11],
            created_at=row[12],
            updated_at=row[13],
            waiting_room=None if row[14] is None else str(row[14]),
            mode=str(row[15]),
            partitions=int(row[16]),
            paused_at=row[17],
            pause_reason=None if row[18] is None else str(row[18]),
        )

    def public(self, remaining: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "unit_price": self.unit_price,
            "currency": self.currency,
            "starts_at": iso(self.starts_at),
            "ends_at": iso(self.ends_at),
            "sold_out": remaining <= 0,
            "remaining_hint": max(0, remaining),
            "mode": self.mode,
        }

    def admin(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "unit_price": self.unit_price,
            "currency": self.currency,
            "buckets": self.bucket_count,
            "partitions": self.partitions,
            "layout_epoch": self.layout_epoch,
            "hold_seconds": self.hold_seconds,
            "per_user_limit": self.per_user_limit,
            "max_per_order": self.max_per_order,
            "capture_mode": self.capture_mode,
            "mode": self.mode,
            "starts_at": iso(self.starts_at),
            "ends_at": iso(self.ends_at),
            "created_at": iso(self.created_at),
            "updated_at": iso(self.updated_at),
            "waiting_room": room_view(self.waiting_room),
            "paused": (
                {"since": iso(self.paused_at), "reason": self.pause_reason}
                if self.paused_at is not None
                else None
            ),
        }


async def get_deal(db: Database, deal_id: int) -> Deal | None:
    row = await db.fetchone(f"SELECT {_DEAL_COLUMNS} FROM deals WHERE id = %s", (deal_id,))
    return Deal.from_row(row) if row else None


def split_evenly(units: int, parts: int) -> list[int]:
    base, extra = divmod(units, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def plan_adjustment(available: dict[int, int], delta: int) -> dict[int, int] | None:
    """Per-bucket deltas: additions spread evenly, removals from the fullest buckets.
    None when a removal exceeds what is available (held stock is never touched)."""
    if delta > 0:
        return {b: n for b, n in enumerate(split_evenly(delta, len(available))) if n}
    need = -delta
    if sum(available.values()) < need:
        return None
    deltas: dict[int, int] = {}
    for b, a in sorted(available.items(), key=lambda kv: -kv[1]):
        take = min(a, need)
        if take:
            deltas[b] = -take
            need -= take
        if need == 0:
            break
    return deltas


CREATE_FIELDS = {
    "title",
    "unit_price",
    "currency",
    "stock",
    "buckets",
    "hold_seconds",
    "per_user_limit",
    "max_per_order",
    "starts_at",
    "ends_at",
    "capture_mode",
    "waiting_room",
    "mode",
    "partitions",
}


# A ledger note: an operator's action on a deal that moves no units (the waiting
# room's message, a dead letter's retry), ledgered beside the stock changes so that a
# deal's ledger names everything done to it. Its deltas are zero: the ledger's sums,
# which `gate check` compares with the counters, are unchanged.
NOTE_MAX_CHARS = 255


async def ledger_note(cur: Any, deal_id: int, reason: str, actor: str, note: str) -> bool:
    """Within the caller's transaction (its cursor): one zero-delta row on bucket 0,
    its available units before and after as they are. False for a deal without
    bucket rows (no such deal)."""
    # A plain (consistent) read: the bucket row is not locked against the sale.
    await cur.execute(
        "SELECT available FROM deal_buckets WHERE deal_id = %s AND bucket = 0", (deal_id,)
    )
    row = await cur.fetchone()
    if row is None:
        return False
    await cur.execute(
        "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held, d_sold,"
        " available_before, available_after, reason, actor, note)"
        " VALUES (%s, 0, 0, 0, 0, 0, %s, %s, %s, %s, %s)",
        (deal_id, row[0], row[0], reason, actor, note[:NOTE_MAX_CHARS]),
    )
    return True


class Deals:
    def __init__(self, db: Database, mirror: Mirror, unknown: UnknownDeals | None = None) -> None:
        self.db = db
        self.mirror = mirror
        self.unknown = unknown or UnknownDeals(mirror.redis, db)
        self._public: dict[int, tuple[float, Deal]] = {}
        self._filling: SingleFlight[int, Deal] = SingleFlight()

    async def create(self, body: Any, actor: str = "admin") -> dict[str, Any]:
        body = validate.obj(body)
        validate.no_unknown(body, CREATE_FIELDS)
        title = validate.string(body, "title", 200)
        unit_price = validate.integer(body, "unit_price", 0, MAX_PRICE)
        currency = validate.string(body, "currency", 3, pattern=CURRENCY_RE)
        stock = validate.integer(body, "stock", 0, MAX_STOCK)
        buckets = validate.integer(body, "buckets", 1, MAX_BUCKETS, default=1)
        hold_seconds = validate.integer(body, "hold_seconds", 1, 86_400, default=600)
        per_user_limit = validate.optional_integer(body, "per_user_limit", 1, MAX_STOCK)
        max_per_order = validate.integer(body, "max_per_order", 1, 1000, default=1)
        starts_at = validate.timestamp(body, "starts_at")
        ends_at = validate.timestamp(body, "ends_at")
        capture_mode = validate.string(body, "capture_mode", 16, default="automatic")
        if capture_mode not in ("automatic", "manual"):
            raise invalid("'capture_mode' must be 'automatic' or 'manual'.")
        mode = validate.string(body, "mode", 8, default="sync")
        if mode not in ("sync", "queue"):
            raise invalid("'mode' must be 'sync' or 'queue'.")
        if per_user_limit is not None and max_per_order > per_user_limit:
            raise invalid("'max_per_order' cannot exceed 'per_user_limit'.")
        if starts_at and ends_at and ends_at <= starts_at:
            raise invalid("'ends_at' must be after 'starts_at'.")
        room = parse_room(body.get("waiting_room"))
        # Fixed for the deal's life: a partition owns the buckets b MOD P, so neither
        # P nor the bucket count may change once buyers are routed (docs/scale-out.md).
        partitions = validate.integer(body, "partitions", 1, PARTITIONS_MAX, default=1)
        if partitions > buckets:
            raise invalid("'partitions' cannot exceed 'buckets' (each partition owns buckets).")
        if partitions > 1 and (room is not None or mode != "sync"):
            raise invalid("'partitions' above 1 cannot go with a waiting room or queue mode.")

        shares = split_evenly(stock, buckets)
        async with self.db.connection() as conn, conn.cursor() as cur:
            await cur.execute("START TRANSACTION")
            await cur.execute(
                "INSERT INTO deals (title, unit_price, currency, bucket_count, hold_seconds,"
                " per_user_limit, max_per_order, capture_mode, starts_at, ends_at, waiting_room,"
                " room_logo, mode, partitions)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    title,
                    unit_price,
                    currency,
                    buckets,
                    hold_seconds,
                    per_user_limit,
                    max_per_order,
                    capture_mode,
                    starts_at,
                    ends_at,
                    room.to_column() if room else None,
                    room.logo_column() if room else None,
                    mode,
                    partitions,
                ),
            )
            deal_id = int(cur.lastrowid)
            await cur.executemany(
                "INSERT INTO deal_buckets (deal_id, bucket, epoch, total, available)"
                " VALUES (%s, %s, 0, %s, %s)",
                [(deal_id, b, n, n) for b, n in enumerate(shares)],
            )
            await cur.executemany(
                "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available, d_held,"
                " d_sold, available_before, available_after, reason, actor)"
                " VALUES (%s, %s, %s, %s, 0, 0, 0, %s, 'create', %s)",
                [(deal_id, b, n, n, n, actor) for b, n in enumerate(shares)],
            )
            await cur.execute("COMMIT")
        # Before the 201: from now on no gate process may answer 404 for this id.
        await self.unknown.created()
        await self._refresh_redis(deal_id)
        deal = await get_deal(self.db, deal_id)
        assert deal is not None
        return {**deal.admin(), "stock": stock}

    async def public_view(self, deal_id: int) -> dict[str, Any]:
        deal = await self._cached(deal_id)
        try:
            remaining = await self.mirror.available(deal_id)
        except RedisError as exc:
            # Redis is in trouble: the database still knows the answer, at a higher
            # price, and this view is a hint anyway.
            log.warning("deal %s: Redis unavailable for the deal view: %r", deal_id, exc)
            row = await self.db.fetchone(
                "SELECT COALESCE(SUM(b.available), 0) FROM deal_buckets b JOIN deals d"
                " ON d.id = b.deal_id AND d.layout_epoch = b.epoch WHERE b.deal_id = %s",
                (deal_id,),
            )
            remaining = int(row[0]) if row else 0
        if remaining is None:
            raise not_found("deal")
        return deal.public(remaining)

    async def cached(self, deal_id: int) -> Deal:
        """The deal's row, at most PUBLIC_CACHE_SECONDS old; 404 for an unknown id (a
        random one without the database). For reads that show a deal to buyers."""
        return await self._cached(deal_id)

    async def _cached(self, deal_id: int) -> Deal:
        hit = self._public.get(deal_id)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        # Concurrent misses of one deal share one read (gate/base/singleflight.py).
        return await self._filling.run(deal_id, lambda: self._fill(deal_id))

    async def _fill(self, deal_id: int) -> Deal:
        now = time.monotonic()
        # Unknown ids (a flood of random ones, say) are answered without the database.
        generation = await self.unknown.generation()
        if self.unknown.unknown(deal_id, generation):
            raise not_found("deal")
        deal = await get_deal(self.db, deal_id)
        if deal is None:
            await self.unknown.learn(deal_id, generation)
            raise not_found("deal")
        if len(self._public) >= PUBLIC_CACHE_MAX:
            self._public.clear()
        self._public[deal_id] = (now + PUBLIC_CACHE_SECONDS, deal)
        return deal

    async def admin_view(self, deal_id: int) -> dict[str, Any]:
        deal = await get_deal(self.db, deal_id)
        if deal is None:
            raise not_found("deal")
        report = await check_deal(self.db, self.mirror.redis, deal_id)
        return {**deal.admin(), **report}

    async def adjust_stock(self, deal_id: int, body: Any, actor: str = "admin") -> dict[str, Any]:
        body = validate.obj(body)
        validate.no_unknown(body, {"delta", "reason"})
        delta = validate.integer(body, "delta", -MAX_STOCK, MAX_STOCK)
        if delta == 0:
            raise invalid("'delta' must not be zero.")
        reason = validate.string(body, "reason", 255)

        op_id = new_id()

        async def attempt() -> dict[int, int]:
            async with self.db.connection() as conn, conn.cursor() as cur:
                await cur.execute("START TRANSACTION")
                await cur.execute(
                    "SELECT layout_epoch FROM deals WHERE id = %s FOR UPDATE", (deal_id,)
                )
                row = await cur.fetchone()
                if row is None:
                    await cur.execute("ROLLBACK")
                    raise not_found("deal")
                await cur.execute(
                    "SELECT bucket, available FROM deal_buckets WHERE deal_id = %s AND epoch = %s"
                    " ORDER BY bucket FOR UPDATE",
                    (deal_id, row[0]),
                )
                avail = {int(b): int(a) for b, a in await cur.fetchall()}
                deltas = plan_adjustment(avail, delta)
                if deltas is None:
                    await cur.execute("ROLLBACK")
                    raise Problem(
                        "CONFLICT",
                        f"Cannot remove {-delta} unit(s): only {sum(avail.values())} available.",
                    )
                for b, d in deltas.items():
                    # The same conditional form as a reservation: the row, not this
                    # process, decides whether the units are there.
                    await cur.execute(
                        "UPDATE deal_buckets SET total = total + %s, available = available + %s,"
                        " updated_at = NOW(6) WHERE deal_id = %s AND bucket = %s"
                        " AND available + %s >= 0",
                        (d, d, deal_id, b, d),
                    )
                    if cur.rowcount != 1:
                        await cur.execute("ROLLBACK")
                        raise Problem("CONFLICT", "Stock changed concurrently; retry.")
                    await cur.execute(
                        "INSERT INTO inventory_ledger (deal_id, bucket, op_id, d_total,"
                        " d_available, d_held, d_sold, available_before, available_after,"
                        " reason, actor, note)"
                        " VALUES (%s, %s, %s, %s, %s, 0, 0, %s, %s, 'adjust', %s, %s)",
                        (deal_id, b, op_id, d, d, avail[b], avail[b] + d, actor, reason),
                    )
                # The intent must exist before the change can be seen committed; the
                # bucket rows stay locked only for this one short Redis call.
                parts = ",".join(f"{b}:{d}" for b, d in sorted(deltas.items()))
                try:
                    await self.mirror.intend(deal_id, [Intent(op_id, 0, 0, parts)])
                except Exception as exc:
                    log.warning("deal %s: adjustment intent not recorded: %r", deal_id, exc)
                await cur.execute("COMMIT")
                return deltas

        await self.db.retrying(attempt)
        try:
            await self.mirror.apply(deal_id, [(op_id, True)])
        except Exception as exc:
            log.warning("deal %s: stock adjusted in the database, Redis deferred: %r", deal_id, exc)
        return await self.admin_view(deal_id)

    async def rebucket(self, deal_id: int, body: Any, actor: str = "admin") -> dict[str, Any]:
        body = validate.obj(body)
        validate.no_unknown(body, {"count"})
        count = validate.integer(body, "count", 1, MAX_BUCKETS)

        async def attempt() -> None:
            async with self.db.connection() as conn, conn.cursor() as cur:
                await cur.execute("START TRANSACTION")
                await cur.execute(
                    "SELECT bucket_count, layout_epoch, partitions FROM deals WHERE id = %s"
                    " FOR UPDATE",
                    (deal_id,),
                )
                row = await cur.fetchone()
                if row is None:
                    await cur.execute("ROLLBACK")
                    raise not_found("deal")
                if int(row[2]) > 1:
                    # Its partitions own buckets by number (b MOD P): a new layout would
                    # move units between partitions under live markers.
                    await cur.execute("ROLLBACK")
                    raise Problem("CONFLICT", "A deal of several partitions cannot be rebucketed.")
                epoch = int(row[1])
                # Every stock transition locks its bucket rows, so holding all of them
                # freezes held/sold while the orders are read below.
                await cur.execute(
                    "SELECT bucket, total, available, held, sold FROM deal_buckets"
                    " WHERE deal_id = %s ORDER BY bucket FOR UPDATE",
                    (deal_id,),
                )
                old = {int(r[0]): tuple(int(x) for x in r[1:]) for r in await cur.fetchall()}
                await cur.execute(
                    "SELECT status, alloc FROM orders WHERE deal_id = %s AND status IN"
                    " ('PENDING_PAYMENT', 'AUTHORIZED', 'PAID')",
                    (deal_id,),
                )
                held = [0] * count
                sold = [0] * count
                for status, alloc in await cur.fetchall():
                    for b, q in parse_alloc(str(alloc)):
                        if status == OrderStatus.PAID:
                            sold[b % count] += q
                        else:
                            held[b % count] += q
                old_avail = sum(v[1] for v in old.values())
                if sum(held) != sum(v[2] for v in old.values()) or sum(sold) != sum(
                    v[3] for v in old.values()
                ):
                    # Counters changed behind the gate's back (an assert here was a 500):
                    # rebucketing would carry the damage into the new layout.
                    await cur.execute("ROLLBACK")
                    raise Problem(
                        "CONFLICT",
                        "The deal's held/sold counters disagree with its orders; nothing"
                        f" changed. Repair them first: gate deal repair {deal_id}.",
                    )
                avail = split_evenly(old_avail, count)
                new = {
                    b: (avail[b] + held[b] + sold[b], avail[b], held[b], sold[b])
                    for b in range(count)
                }
                await cur.execute(
                    "DELETE FROM deal_buckets WHERE deal_id = %s AND bucket >= %s", (deal_id, count)
                )
                await cur.executemany(
                    "INSERT INTO deal_buckets (deal_id, bucket, epoch, total, available, held,"
                    " sold) VALUES (%s, %s, %s, %s, %s, %s, %s) ON DUPLICATE KEY UPDATE"
                    " epoch = VALUES(epoch), total = VALUES(total), available = VALUES(available),"
                    " held = VALUES(held), sold = VALUES(sold), updated_at = NOW(6)",
                    [(deal_id, b, epoch + 1, *new[b]) for b in range(count)],
                )
                ledger = []
                for b in sorted(set(old) | set(new)):
                    o = old.get(b, (0, 0, 0, 0))
                    n = new.get(b, (0, 0, 0, 0))
                    if n == o:
                        continue  # a bucket whose numbers did not change has no row
                    ledger.append(
                        (
                            deal_id,
                            b,
                            n[0] - o[0],
                            n[1] - o[1],
                            n[2] - o[2],
                            n[3] - o[3],
                            o[1],
                            n[1],
                            actor,
                            f"buckets {len(old)} -> {count}",
                        )
                    )
                if ledger:
                    await cur.executemany(
                        "INSERT INTO inventory_ledger (deal_id, bucket, d_total, d_available,"
                        " d_held, d_sold, available_before, available_after, reason, actor,"
                        " note) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'rebucket', %s, %s)",
                        ledger,
                    )
                await cur.execute(
                    "UPDATE deals SET bucket_count = %s, layout_epoch = %s, updated_at = NOW(6),"
                    " version = version + 1 WHERE id = %s",
                    (count, epoch + 1, deal_id),
                )
                await cur.execute("COMMIT")

        await self.db.retrying(attempt)
        await self._refresh_redis(deal_id)
        return await self.admin_view(deal_id)

    async def newest_titled(self, title: str) -> dict[str, Any] | None:
        """The admin view of the newest deal of that title, or None (`gate demo`
        finds its own deal again)."""
        row = await self.db.fetchone(
            "SELECT id FROM deals WHERE title = %s ORDER BY id DESC LIMIT 1", (title,)
        )
        return None if row is None else await self.admin_view(int(row[0]))

    async def list_admin(self, after_id: int, limit: int) -> dict[str, Any]:
        """A page of deals in id order with their stock totals (`gate deal list`)."""
        if not 0 <= after_id <= MAX_ID or not 1 <= limit <= LIST_PAGE_MAX:
            raise invalid(f"'after' must be 0..{MAX_ID} and 'limit' 1..{LIST_PAGE_MAX}.")
        rows = await self.db.fetchall(
            f"SELECT {_DEAL_COLUMNS} FROM deals WHERE id > %s ORDER BY id LIMIT %s",
            (after_id, limit),
        )
        deals = [Deal.from_row(r) for r in rows]
        totals: dict[int, tuple[int, int, int, int]] = {}
        if deals:
            marks = ", ".join(["%s"] * len(deals))
            for r in await self.db.fetchall(
                "SELECT b.deal_id, SUM(b.total), SUM(b.available), SUM(b.held), SUM(b.sold)"
                " FROM deal_buckets b JOIN deals d ON d.id = b.deal_id AND d.layout_epoch ="
                f" b.epoch WHERE b.deal_id IN ({marks}) GROUP BY b.deal_id",
                [d.id for d in deals],
            ):
                totals[int(r[0])] = (int(r[1]), int(r[2]), int(r[3]), int(r[4]))
        items = []
        for d in deals:
            t = totals.get(d.id, (0, 0, 0, 0))
            items.append(
                {
                    **d.admin(),
                    "totals": {"total": t[0], "available": t[1], "held": t[2], "sold": t[3]},
                }
            )
        return {"items": items, "next_after": items[-1]["id"] if len(items) == limit else None}

    async def set_window(self, deal_id: int, body: Any, actor: str = "admin") -> dict[str, Any]:
        """Change the sale window ({"starts_at", "ends_at"}, each a timestamp or null
        for open-ended). Stock does not move, so nothing is ledgered: the change is
        logged with its actor. Redis is rebuilt after the commit, as after a rebucket,
        so admission follows the new window at once."""
        body = validate.obj(body)
        validate.no_unknown(body, {"starts_at", "ends_at"})
        for name in ("starts_at", "ends_at"):
            if name not in body:
                raise invalid(f"'{name}' is required (null for open-ended).")
        starts_at = validate.timestamp(body, "starts_at")
        ends_at = validate.timestamp(body, "ends_at")
        if starts_at and ends_at and ends_at <= starts_at:
            raise invalid("'ends_at' must be after 'starts_at'.")
        before = await get_deal(self.db, deal_id)
        if before is None:
            raise not_found("deal")
        await self.db.execute(
            "UPDATE deals SET starts_at = %s, ends_at = %s, updated_at = NOW(6),"
            " version = version + 1 WHERE id = %s",
            (starts_at, ends_at, deal_id),
        )
        log.warning(
            "deal %s: sale window changed by %s from %s..%s to %s..%s",
            deal_id,
            actor,
            iso(before.starts_at),
            iso(before.ends_at),
            iso(starts_at),
            iso(ends_at),
            extra={"deal_id": deal_id},
        )
        await self._refresh_redis(deal_id)
        return await self.admin_view(deal_id)

    async def ledger(
        self, deal_id: int, after_id: int, limit: int, *, newest_first: bool = False
    ) -> dict[str, Any]:
        """Ledger rows with an id above `after_id`, oldest first (paging), or with
        `newest_first` the latest `limit` of them (the console's view)."""
        if await get_deal(self.db, deal_id) is None:
            raise not_found("deal")
        order = "DESC" if newest_first else "ASC"
        rows = await self.db.fetchall(
            "SELECT id, bucket, order_id, d_total, d_available, d_held, d_sold,"
            " available_before, available_after, reason, actor, note, created_at"
            f" FROM inventory_ledger WHERE deal_id = %s AND id > %s ORDER BY id {order}"
            " LIMIT %s",
            (deal_id, after_id, limit),
        )
        items = [
            {
                "id": int(r[0]),
                "bucket": int(r[1]),
                "order_id": r[2],
                "delta": {
                    "total": int(r[3]),
                    "available": int(r[4]),
                    "held": int(r[5]),
                    "sold": int(r[6]),
                },
                "available_before": int(r[7]),
                "available_after": int(r[8]),
                "reason": r[9],
                "actor": r[10],
                "note": r[11],
                "created_at": iso(r[12]),
            }
            for r in rows
        ]
        return {
            "deal_id": deal_id,
            "items": items,
            "next_after": items[-1]["id"] if len(items) == limit and not newest_first else None,
        }

    async def _refresh_redis(self, deal_id: int) -> None:
        self._public.pop(deal_id, None)
        try:
            await self.mirror.rebuild(deal_id)
            await self.mirror.rebuild_buyers(deal_id)
        except Exception as exc:
            # The deal is committed; Redis loads it on first use or the resync loop
            # repairs it. Dropping the stale state makes sure of the former.
            log.warning("deal %s: Redis rebuild deferred: %r", deal_id, exc)
            try:
                await self.mirror.redis.delete(deal_keys(deal_id).meta)
            except Exception:
                log.warning("deal %s: Redis unreachable; it will be resynced", deal_id)
