"""Repairing a deal's stock counters from its orders (`gate deal repair`).

The orders are the truth for what is held and sold; the ledger is the truth for the
stock the operators gave the deal (every create, adjustment and rebucketing writes
its rows). A counter changed by hand (`UPDATE deal_buckets …` without a ledger row)
breaks `gate check`; this puts the counters back:

    refuse while Redis shows reservations or changes in flight (every queued or
    running group holds admission tokens there), unless told to wait for them
        |
    one transaction (a dry run reads a consistent snapshot and locks nothing):
        deal row, then every bucket row FOR UPDATE   (every stock change locks them,
                                                      so held/sold stand still)
        per bucket b of the layout:
            held_b, sold_b  <- the holding / paid orders' allocations (b MOD count)
            total_b         <- the ledger's summed d_total of b
            available_b     =  total_b - held_b - sold_b
        a bucket whose orders need more than its ledger stock borrows available
        units from the fullest others (the deal's total is kept; no counter goes
        below zero or past its total); a deal whose orders need more than all of
        its stock is refused: that is an oversell for a person to decide
        per-user quota rows (deals with a per-user limit) <- the buyers' holding and
        paid orders
        one ledger row per repaired bucket (reason 'repair', the operator as actor),
        whose deltas bring the ledger's sums to the new counters; one zero-delta row
        noting quota repairs
    COMMIT, then Redis is rebuilt from the database as after a rebucketing (buckets
    with the in-flight markers accounted for; the per-user counts reloaded when
    quota rows changed)
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gate.base.alloc import parse_alloc
from gate.base.codes import OrderStatus
from gate.base.errors import Problem, not_found
from gate.inventory import store
from gate.inventory.mirror import Mirror
from gate.store.db import RETRYABLE_ERRNOS, Database, errno_of
from gate.store.keys import deal_keys

# How often `--wait` looks at the in-flight markers again.
WAIT_POLL_SECONDS = 0.1
WAIT_SECONDS_MAX = 3600
QUOTA_SHOWN_MAX = 100
NOTE_MAX = 255

Counters = tuple[int, int, int, int]  # total, available, held, sold


def _named(c: Counters) -> dict[str, int]:
    return {"total": c[0], "available": c[1], "held": c[2], "sold": c[3]}


@dataclass
class RepairPlan:
    deal_id: int
    bucket_count: int
    # bucket -> (counters now, ledger sums, counters wanted), only buckets that change
    buckets: dict[int, tuple[Counters, Counters, Counters]] = field(default_factory=dict)
    # user -> (units now, units wanted), only rows that change
    quota: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.buckets or self.quota)

    def report(self, *, dry_run: bool, operator: str) -> dict[str, Any]:
        shown = sorted(self.quota.items())[:QUOTA_SHOWN_MAX]
        return {
            "deal_id": self.deal_id,
            "bucket_count": self.bucket_count,
            "dry_run": dry_run,
            "operator": operator,
            "changed": self.changed,
            "applied": self.changed and not dry_run,
            "buckets": [
                {
                    "bucket": b,
                    "before": _named(now),
                    "ledger_before": _named(led),
                    "after": _named(want),
                }
                for b, (now, led, want) in sorted(self.buckets.items())
            ],
            "quota": {
                "rows": len(self.quota),
                "units_before": sum(v[0] for v in self.quota.values()),
                "units_after": sum(v[1] for v in self.quota.values()),
                "shown": [{"user_id": u, "before": a, "after": b} for u, (a, b) in shown],
            },
        }


def refused(detail: str) -> Problem:
    return Problem("CONFLICT", detail)


def plan_counters(
    nb: int,
    ledger_total: dict[int, int],
    held: dict[int, int],
    sold: dict[int, int],
) -> dict[int, Counters]:
    """The wanted counters per bucket of the layout; raises `refused` when the orders
    need more units than the ledger's stock."""
    want: dict[int, list[int]] = {}
    for b in range(nb):
        h, s = held.get(b, 0), sold.get(b, 0)
        t = ledger_total.get(b, 0)
        want[b] = [t, t - h - s, h, s]
    stock = sum(w[0] for w in want.values())
    needed = sum(w[2] + w[3] for w in want.values())
    if needed > stock:
        raise refused(
            f"The deal's orders hold or sold {needed} unit(s) but its ledger records {stock}:"
            " repairing would take available below zero. Add stock first"
            " (gate deal stock ID --delta N --reason R), then repair."
        )
    for b, w in want.items():
        if w[1] >= 0:
            continue
        need = -w[1]
        w[0] += need
        w[1] = 0
        # From the fullest buckets, as a stock removal takes units.
        for _, other in sorted(((o[1], ob) for ob, o in want.items() if ob != b), reverse=True):
            if need == 0:
                break
            take = min(need, want[other][1])
            if take > 0:
                want[other][0] -= take
                want[other][1] -= take
                need -= take
        assert need == 0, "the deal-wide check above guarantees enough available units"
    return {b: (w[0], w[1], w[2], w[3]) for b, w in want.items()}


async def inflight(mirror: Mirror, deal_id: int) -> int:
    """Reservations and stock changes of the deal that Redis shows in flight (in
    every partition of a partitioned deal)."""
    parts = await mirror.partitions(deal_id)
    if parts == 1:
        return int(await mirror.redis.hlen(deal_keys(deal_id).inflight))
    return sum([int(await mirror.redis.hlen(k.inflight)) for k in mirror.keys_of(deal_id, parts)])


async def wait_quiet(mirror: Mirror, deal_id: int, wait_seconds: float) -> None:
    """Return once nothing of the deal is in flight; raise `refused` if that takes
    longer than `wait_seconds` (0: do not wait)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            n = await inflight(mirror, deal_id)
        except Exception as exc:
            raise refused(
                f"Redis is unreachable ({type(exc).__name__}): cannot tell whether"
                " reservations are in flight; nothing changed."
            ) from None
        if n == 0:
            return
        if time.monotonic() >= deadline:
            hint = "" if wait_seconds else " Retry, or give --wait SECONDS."
            raise refused(
                f"Deal {deal_id} has {n} reservation(s) or stock change(s) in flight;"
                f" nothing changed.{hint}"
            )
        await asyncio.sleep(WAIT_POLL_SECONDS)


async def _read_and_plan(cur: Any, deal_id: int, lock: str) -> RepairPlan:
    row = await store.repair_deal(cur, deal_id, lock)
    if row is None:
        raise not_found("deal")
    nb, epoch, limit = int(row[0]), int(row[1]), row[2]
    rows = {
        int(r[0]): (int(r[1]), (int(r[2]), int(r[3]), int(r[4]), int(r[5])))
        for r in await store.repair_buckets(cur, deal_id, lock)
    }
    if set(rows) != set(range(nb)) or any(e != epoch for e, _ in rows.values()):
        raise refused(
            f"Deal {deal_id}'s bucket rows do not match its layout of {nb} bucket(s), epoch"
            f" {epoch}: repair fixes counters, not layouts; see gate check --deal {deal_id}."
        )
    ledger: dict[int, Counters] = {
        int(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4]))
        for r in await store.repair_ledger(cur, deal_id)
    }
    removed = {b: v for b, v in ledger.items() if b >= nb and any(v)}
    if removed:
        raise refused(
            f"Deal {deal_id}'s removed buckets {sorted(removed)} still carry ledger stock:"
            " repair fixes counters, not layouts."
        )
    held: dict[int, int] = defaultdict(int)
    sold: dict[int, int] = defaultdict(int)
    units: dict[int, int] = defaultdict(int)
    for user_id, quantity, status, alloc in await store.repair_orders(cur, deal_id):
        parts = parse_alloc(str(alloc))
        if sum(q for _, q in parts) != int(quantity):
            raise refused(
                f"An order's allocation {alloc!r} does not add up to its quantity {quantity}:"
                " the orders themselves are damaged; escalate."
            )
        for b, q in parts:
            (sold if status == OrderStatus.PAID else held)[b % nb] += q
        units[int(user_id)] += int(quantity)

    want = plan_counters(nb, {b: v[0] for b, v in ledger.items()}, held, sold)
    plan = RepairPlan(deal_id, nb)
    for b in range(nb):
        now = rows[b][1]
        led = ledger.get(b, (0, 0, 0, 0))
        if now != want[b] or led != want[b]:
            plan.buckets[b] = (now, led, want[b])
    if limit is not None:
        have = {int(u): int(n) for u, n in await store.repair_quota(cur, deal_id, lock)}
        for user in set(have) | set(units):
            if have.get(user, 0) != units.get(user, 0):
                plan.quota[user] = (have.get(user, 0), units.get(user, 0))
    return plan


async def repair(
    db: Database,
    mirror: Mirror,
    deal_id: int,
    *,
    operator: str,
    dry_run: bool,
    wait_seconds: float = 0.0,
) -> dict[str, Any]:
    """Plan (and unless `dry_run`, apply) the repair of one deal; the report."""
    if dry_run:
        async with db.snapshot() as cur:
            plan = await _read_and_plan(cur, deal_id, "")
        return plan.report(dry_run=True, operator=operator)

    await wait_quiet(mirror, deal_id, wait_seconds)

    async def attempt() -> RepairPlan:
        async with db.connection() as conn, conn.cursor() as cur:
            await store.begin(cur)
            try:
                plan = await _read_and_plan(cur, deal_id, " FOR UPDATE")
                if plan.changed:
                    await _apply(cur, plan, operator)
            except BaseException:
                await store.rollback(cur)
                raise
            await store.commit(cur)
            return plan

    try:
        plan = await db.retrying(attempt)
    except Exception as exc:
        if errno_of(exc) not in RETRYABLE_ERRNOS:
            raise
        # Still locked after the retries: a transaction of the deal (a reservation
        # whose in-flight mark has gone, a stock change) holds its rows.
        raise refused(
            f"Deal {deal_id}'s rows stayed locked by a reservation or stock change in"
            " flight; nothing changed. Retry, or give --wait SECONDS."
        ) from None
    if plan.changed:
        await _refresh_redis(mirror, deal_id, quota_changed=bool(plan.quota))
    return plan.report(dry_run=False, operator=operator)


async def _apply(cur: Any, plan: RepairPlan, operator: str) -> None:
    deal_id = plan.deal_id
    ledger = []
    for b, (now, led, want) in sorted(plan.buckets.items()):
        await store.set_counters(cur, want, deal_id, b)
        note = f"counters {now} -> {want}; ledger summed {led}"
        ledger.append(
            (
                deal_id,
                b,
                # The deltas bring the ledger's sums to the new counters: a change made
                # without a ledger row is accounted for here.
                want[0] - led[0],
                want[1] - led[1],
                want[2] - led[2],
                want[3] - led[3],
                now[1],
                want[1],
                operator,
                note[:NOTE_MAX],
            )
        )
    if plan.quota:
        await store.set_quotas(
            cur, [(deal_id, u, want) for u, (_, want) in sorted(plan.quota.items())]
        )
        # A row in the ledger for the audit trail; its deltas are zero (quota is not stock).
        first = plan.buckets.get(0)
        avail0 = first[2][1] if first else None
        if avail0 is None:
            avail0 = await store.bucket_zero_available(cur, deal_id)
        before = sum(v[0] for v in plan.quota.values())
        after = sum(v[1] for v in plan.quota.values())
        note = (
            f"per-user quota of {len(plan.quota)} buyer(s) recomputed from orders:"
            f" units {before} -> {after}"
        )
        ledger.append((deal_id, 0, 0, 0, 0, 0, avail0, avail0, operator, note[:NOTE_MAX]))
    await store.repair_ledger_rows(cur, ledger)


async def _refresh_redis(mirror: Mirror, deal_id: int, *, quota_changed: bool) -> None:
    """Redis follows the repaired database, as after a rebucketing: the buckets rebuilt
    with the in-flight markers accounted for (lua/sync_deal.lua, mode 'layout'). The
    per-user counts are only built by a load, so after a quota repair the deal's state
    is dropped and loaded again from the database, as after a Redis flush, which the
    mirror is built to survive (docs/redis-mirror.md); nothing was in flight a moment
    ago."""
    if quota_changed:
        await mirror.forget(deal_id)
        await mirror.load(deal_id)
    else:
        await mirror.rebuild(deal_id)
