"""The post-run verifier: invariants, Redis = DB, order-state counts, and the client record.

    python -m loadtest.verify [--record client.json] [--deal ID …] [--json]
        gate mode (default): the gate's database and Redis (GATE_MYSQL_URL,
        GATE_REDIS_URL); every check of `gate check` once nothing is in flight,
        plus oversold / lost units from the order rows, the order-state counts,
        and the record's orders held against the database; every callback the
        gate answered 2xx must have its payment_events row ("payment lost").
    python -m loadtest.verify --baseline …
        the peer baseline's database (BASELINE_MYSQL_URL, see loadtest.baseline).
    python -m loadtest.verify --api URL --admin-token T …
        a remote gate without database access: the admin view's invariant verdict
        and the record's orders read back through the buyer API.

Prints a summary; exit status 0 when everything holds, 1 on any breach, 2 on a
usage or connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from loadtest.record import NO_ANSWER, ClientRecord, OrderRef, acknowledged

HOLDING = ("PENDING_PAYMENT", "AUTHORIZED")
KEEPING = (*HOLDING, "PAID")
RELEASED = ("EXPIRED", "CANCELLED", "REFUND_PENDING", "REFUNDED")
LATE_ENDS = ("PAID", "REFUND_PENDING", "REFUNDED")
LOOKUP_CHUNK = 1000
API_ORDERS_MAX = 2000


def _chunks(items: list[OrderRef], size: int) -> Iterable[list[OrderRef]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# -- the parts shared by every mode -------------------------------------------------------


def stock_numbers(
    totals: Mapping[str, int], states: Mapping[str, Mapping[str, int]]
) -> dict[str, int]:
    """Oversold and lost units from the order rows, independent of the bucket counters."""
    ordered = sum(states.get(s, {}).get("units", 0) for s in KEEPING)
    total, available = int(totals["total"]), int(totals["available"])
    oversold = max(0, ordered - total)
    gap = total - available - ordered
    return {
        "total": total,
        "available": available,
        "ordered": ordered,
        "oversold": oversold,
        "lost": gap if gap > 0 and not oversold else 0,
        "phantom": -gap if gap < 0 and not oversold else 0,
    }


def record_breaches(
    record: ClientRecord | None,
    deal_id: int,
    found: Mapping[str, tuple[int, int, str]],
    numbers: Mapping[str, int],
    states: Mapping[str, Mapping[str, int]],
) -> tuple[list[str], dict[str, Any]]:
    """The record's view of one deal against what the database holds."""
    if record is None:
        return [], {}
    breaches: list[str] = []
    created = [r for r in record.created if r[2] == deal_id]
    missing = [r for r in created if r[0] not in found]
    wrong = [r for r in created if r[0] in found and found[r[0]][:2] != (r[1], r[2])]
    for order_id, user, _ in missing[:5]:
        breaches.append(f"lost order: a client got 201 for {order_id} (user {user}), no row")
    if len(missing) > 5:
        breaches.append(f"… {len(missing) - 5} more orders answered 201 but missing")
    for order_id, user, _ in wrong[:5]:
        owner = found[order_id][:2]
        breaches.append(f"order {order_id}: belongs to {owner}, client saw user {user}")
    for order_id, _, _ in (r for r in record.paid if r[2] == deal_id):
        status = found.get(order_id, (0, 0, "missing"))[2]
        if status != "PAID":
            breaches.append(f"order {order_id}: paid in time but {status}")
    for order_id, _, _ in (r for r in record.late_paid if r[2] == deal_id):
        status = found.get(order_id, (0, 0, "missing"))[2]
        if status not in LATE_ENDS:
            breaches.append(f"order {order_id}: paid late but {status} (expected {LATE_ENDS})")
    answers: dict[str, int] = {}
    for d in record.deliveries:
        if d[1] == deal_id:
            label = "none" if d[4] == NO_ANSWER else str(d[4])
            answers[label] = answers.get(label, 0) + 1
    unpaid = [r for r in record.unpaid if r[2] == deal_id]
    outcomes = record.outcomes.get(deal_id, {})
    released = sum(states.get(s, {}).get("count", 0) for s in RELEASED)
    transient = sum(
        v for k, v in outcomes.items() if k.startswith("5") or k in ("OVERLOADED", "NO_ANSWER")
    )
    warnings = []
    if outcomes.get("SOLD_OUT") and numbers["available"] > 0 and released == 0:
        text = (
            f"ghost stock: clients were told SOLD_OUT while {numbers['available']} unit(s)"
            " are still available and none was released"
        )
        # A unit given back after a failed database write (503) may legitimately come
        # back after the crowd stopped clicking: one per such answer (the scenarios
        # reserve one unit at a time), no more.
        (warnings if numbers["available"] <= transient else breaches).append(text)
    if unpaid:
        # The gate never answered 2xx to any delivery of these payments: it did not
        # take them, and nothing may be expected of them (not a breach of the gate's).
        warnings.append(
            f"{len(unpaid)} payment(s) got no 2xx on any delivery, not counted as paid:"
            f" {', '.join(r[0] for r in unpaid[:3])}"
        )
    summary = {
        "client_201": len(created),
        "client_missing": len(missing),
        "outcomes": dict(outcomes),
        "deliveries": answers,
        "unpaid": len(unpaid),
        "warnings": warnings,
    }
    return breaches, summary


# -- gate mode: database and Redis --------------------------------------------------------


async def _states(db: Any, deal_id: int) -> dict[str, dict[str, int]]:
    rows = await db.fetchall(
        "SELECT status, COUNT(*), COALESCE(SUM(quantity), 0) FROM orders WHERE deal_id = %s"
        " GROUP BY status",
        (deal_id,),
    )
    return {str(s): {"count": int(n), "units": int(u)} for s, n, u in rows}


async def _lookup(db: Any, refs: list[OrderRef]) -> dict[str, tuple[int, int, str]]:
    found: dict[str, tuple[int, int, str]] = {}
    for chunk in _chunks(refs, LOOKUP_CHUNK):
        marks = ", ".join(["%s"] * len(chunk))
        rows = await db.fetchall(
            f"SELECT id, user_id, deal_id, status FROM orders WHERE id IN ({marks})",
            [r[0] for r in chunk],
        )
        for order_id, user, deal, status in rows:
            found[str(order_id)] = (int(user), int(deal), str(status))
    return found


async def lost_payments(db: Any, record: ClientRecord | None, deal_id: int) -> list[str]:
    """Callbacks of this deal the gate answered 2xx that it has no payment_events row
    for: an acknowledged payment it did not record (a lost payment)."""
    if record is None:
        return []
    acked = {d[2]: d for d in record.deliveries if d[1] == deal_id and acknowledged(d[4])}
    ids = sorted(acked)
    known: set[str] = set()
    for i in range(0, len(ids), LOOKUP_CHUNK):
        chunk = ids[i : i + LOOKUP_CHUNK]
        marks = ", ".join(["%s"] * len(chunk))
        rows = await db.fetchall(
            f"SELECT event_id FROM payment_events WHERE event_id IN ({marks})", chunk
        )
        known.update(str(r[0]) for r in rows)
    lost = [acked[e] for e in ids if e not in known]
    breaches = [
        f"payment lost: the gate answered {d[4]} to event {d[2]} ({d[3]}) of order {d[0]}"
        " and has no payment_events row for it"
        for d in lost[:5]
    ]
    if len(lost) > 5:
        breaches.append(f"… {len(lost) - 5} more acknowledged events not recorded")
    return breaches


def _expected_done(
    record: ClientRecord | None, found: Mapping[str, tuple[int, int, str]], deal_id: int
) -> bool:
    if record is None:
        return True
    paid_ok = all(found.get(r[0], (0, 0, ""))[2] == "PAID" for r in record.paid if r[2] == deal_id)
    late_ok = all(
        found.get(r[0], (0, 0, ""))[2] in LATE_ENDS for r in record.late_paid if r[2] == deal_id
    )
    return paid_ok and late_ok


async def verify_gate_deal(
    db: Any,
    rds: Any,
    deal_id: int,
    record: ClientRecord | None = None,
    settle_seconds: float = 15.0,
) -> dict[str, Any]:
    """One deal's verdict, once nothing is in flight (or the settle time ran out)."""
    from gate.inventory.check import check_deal

    refs: list[OrderRef] = []
    if record is not None:
        refs = [r for r in (*record.created, *record.paid, *record.late_paid) if r[2] == deal_id]
    deadline = time.monotonic() + settle_seconds
    while True:
        report = await check_deal(db, rds, deal_id)
        found = await _lookup(db, refs)
        settled = (
            report["invariant"]["ok"]
            and (report["redis"].get("compared") or not report["redis"].get("loaded"))
            and _expected_done(record, found, deal_id)
        )
        if settled or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.25)
    breaches = list(report["invariant"]["breaches"])
    if "totals" not in report:
        return {"deal_id": deal_id, "ok": False, "breaches": breaches}
    redis = report["redis"]
    if redis.get("error"):
        # An unreachable Redis must not read as "nothing to compare".
        breaches.append(f"redis: unreachable ({redis['error']}); Redis = DB not checked")
    if redis.get("loaded") and not redis.get("compared"):
        breaches.append(
            f"redis: not comparable after {settle_seconds:g} s"
            f" ({redis.get('in_flight', '?')} in flight)"
        )
    states = await _states(db, deal_id)
    numbers = stock_numbers(report["totals"], states)
    if numbers["oversold"]:
        breaches.append(f"oversold: orders keep {numbers['ordered']} units of {numbers['total']}")
    if numbers["lost"]:
        breaches.append(f"lost units: {numbers['lost']} neither available nor in an order")
    if numbers["phantom"]:
        breaches.append(f"phantom units: {numbers['phantom']} more available than stock allows")
    created_stock = record.stocks.get(deal_id) if record is not None else None
    if created_stock is not None:
        # Against the stock the run created the deal with, not the counters (which a
        # bug could raise together with the ledger): a load test adjusts no stock.
        if numbers["total"] != created_stock:
            breaches.append(
                f"stock changed: the deal was created with {created_stock} unit(s), its"
                f" counters now total {numbers['total']}"
            )
        if numbers["ordered"] > created_stock:
            breaches.append(
                f"oversold: orders keep {numbers['ordered']} units of the {created_stock}"
                " the deal was created with"
            )
    extra, client = record_breaches(record, deal_id, found, numbers, states)
    breaches.extend(extra)
    breaches.extend(await lost_payments(db, record, deal_id))
    room = redis.get("room")
    if room and not room.get("within_stock_bound", True):
        # Its counters are checked by gate check (among the breaches above); the bound
        # at the default ratio 1: unspent admissions never exceed the units left.
        breaches.append(
            f"room: {room['unspent']} unspent admissions for {numbers['available']} unit(s)"
        )
    if redis.get("compared"):
        redis_text = "equal" if not any(b.startswith("redis") for b in breaches) else "DRIFT"
    elif redis.get("loaded"):
        redis_text = "not compared"
    else:
        redis_text = "not loaded"
    return {
        "deal_id": deal_id,
        "ok": not breaches,
        "breaches": breaches,
        "numbers": numbers,
        "held": report["totals"]["held"],
        "sold": report["totals"]["sold"],
        "buckets": report["bucket_count"],
        "states": states,
        "redis": redis_text,
        "client": client,
        **({"room": room} if room else {}),
    }


# -- baseline mode ------------------------------------------------------------------------


async def verify_baseline_deal(
    db: Any, deal_id: int, record: ClientRecord | None = None
) -> dict[str, Any]:
    from loadtest.baseline.store import check_deal

    report = await check_deal(db, deal_id)
    breaches = list(report["invariant"]["breaches"])
    if "totals" not in report:
        return {"deal_id": deal_id, "ok": False, "breaches": breaches}
    states = {s: dict(v) for s, v in report["orders"].items()}
    numbers = stock_numbers(report["totals"], states)
    refs = [r for r in record.created if r[2] == deal_id] if record else []
    found = await _lookup(db, refs) if refs else {}
    extra, client = record_breaches(record, deal_id, found, numbers, states)
    breaches.extend(extra)
    return {
        "deal_id": deal_id,
        "ok": not breaches,
        "breaches": breaches,
        "numbers": numbers,
        "states": states,
        "redis": "none (DB only)",
        "client": client,
    }


# -- API mode: a remote gate --------------------------------------------------------------


async def verify_api_deal(
    base_url: str,
    admin_token: str,
    jwt_secret: str | None,
    deal_id: int,
    record: ClientRecord | None = None,
    settle_seconds: float = 15.0,
) -> dict[str, Any]:
    import aiohttp

    from loadtest.tokens import TokenMint

    admin = {"Authorization": f"Bearer {admin_token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        deadline = time.monotonic() + settle_seconds
        while True:
            async with http.get(f"{base_url}/v1/admin/deals/{deal_id}", headers=admin) as r:
                if r.status != 200:
                    text = await r.text()
                    return {
                        "deal_id": deal_id,
                        "ok": False,
                        "breaches": [f"admin view answered {r.status}: {text[:200]}"],
                    }
                view = orjson.loads(await r.read())
            if (view["invariant"]["ok"] and view["redis"].get("compared")) or (
                time.monotonic() >= deadline
            ):
                break
            await asyncio.sleep(0.5)
        breaches = list(view["invariant"]["breaches"])
        if view["redis"].get("loaded") and not view["redis"].get("compared"):
            breaches.append("redis: not comparable in the settle time")
        totals = view["totals"]
        # The admin view has units, not order counts, per state.
        states = {
            "HELD": {"count": -1, "units": int(view["orders"]["held"])},
            "PAID": {"count": -1, "units": int(view["orders"]["sold"])},
        }
        numbers = stock_numbers(totals, {"PENDING_PAYMENT": states["HELD"], "PAID": states["PAID"]})
        found: dict[str, tuple[int, int, str]] = {}
        if record is not None and jwt_secret:
            mint = TokenMint(jwt_secret)
            refs = [
                r for r in (*record.created, *record.paid, *record.late_paid) if r[2] == deal_id
            ]
            for order_id, user, deal in refs[:API_ORDERS_MAX]:
                headers = {"Authorization": f"Bearer {mint.token(user)}"}
                async with http.get(f"{base_url}/v1/orders/{order_id}", headers=headers) as r:
                    if r.status == 200:
                        body = orjson.loads(await r.read())
                        found[order_id] = (user, int(body.get("deal_id", deal)), body["status"])
            if record is not None:
                record = _limited(record, deal_id, API_ORDERS_MAX)
        extra, client = record_breaches(record, deal_id, found, numbers, states)
    breaches.extend(extra)
    return {
        "deal_id": deal_id,
        "ok": not breaches,
        "breaches": breaches,
        "numbers": numbers,
        "held": totals["held"],
        "sold": totals["sold"],
        "states": states,
        "redis": "equal" if view["redis"].get("compared") else "not compared",
        "client": client,
    }


def _limited(record: ClientRecord, deal_id: int, limit: int) -> ClientRecord:
    """The part of the record that API mode looked up (it reads orders one by one)."""
    refs = [r for r in (*record.created, *record.paid, *record.late_paid) if r[2] == deal_id]
    kept = set(r[0] for r in refs[:limit])
    out = ClientRecord(host=record.host, deals=record.deals, violations=record.violations)
    out.created = [r for r in record.created if r[0] in kept]
    out.paid = [r for r in record.paid if r[0] in kept]
    out.late_paid = [r for r in record.late_paid if r[0] in kept]
    out.outcomes = record.outcomes
    return out


# -- the whole run ------------------------------------------------------------------------


def finish(deals: list[dict[str, Any]], record: ClientRecord | None) -> dict[str, Any]:
    run_breaches = []
    if record is not None:
        run_breaches = [f"client: {v}" for v in record.violations]
    ok = all(d["ok"] for d in deals) and not run_breaches
    return {"ok": ok, "deals": deals, "run_breaches": run_breaches}


def render(report: Mapping[str, Any], roles: Mapping[int, str] | None = None) -> str:
    roles = roles or {}
    lines = []
    for deal in report["deals"]:
        role = f" [{roles[deal['deal_id']]}]" if deal["deal_id"] in roles else ""
        verdict = "OK" if deal["ok"] else "BREACH"
        if "numbers" not in deal:
            lines.append(f"deal {deal['deal_id']}{role}: {verdict}")
        else:
            n = deal["numbers"]
            states = " ".join(
                f"{s}={v['count']}" if v["count"] >= 0 else f"{s} units={v['units']}"
                for s, v in sorted(deal["states"].items())
            )
            lines.append(
                f"deal {deal['deal_id']}{role}: {verdict}  stock={n['total']}"
                f" available={n['available']} ordered={n['ordered']}"
                f" oversold={n['oversold']} lost={n['lost']}  redis: {deal['redis']}"
            )
            lines.append(f"    orders: {states or 'none'}")
            room = deal.get("room")
            if room:
                lines.append(
                    f"    room: waiting={room['waiting']} admitted={room['admitted']}"
                    f" spent={room['spent']} lapsed={room['lapsed']} unspent={room['unspent']}"
                )
            client = deal.get("client") or {}
            if client:
                outcomes = " ".join(f"{k}={v}" for k, v in sorted(client["outcomes"].items()))
                lines.append(
                    f"    client: 201s={client['client_201']}"
                    f" missing={client['client_missing']}  answers: {outcomes or 'none'}"
                )
                if client.get("deliveries"):
                    answers = " ".join(f"{k}={v}" for k, v in sorted(client["deliveries"].items()))
                    lines.append(
                        f"    callbacks: answers: {answers}  unpaid: {client.get('unpaid', 0)}"
                    )
                for warning in client.get("warnings", []):
                    lines.append(f"    ~ {warning}")
        for breach in deal["breaches"]:
            lines.append(f"    ! {breach}")
    for breach in report.get("run_breaches", []):
        lines.append(f"  ! {breach}")
    lines.append("verifier: all checks hold" if report["ok"] else "verifier: BREACH")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gate.base.settings import load_settings
    from gate.store.db import Database

    record = ClientRecord.read(Path(args.record)) if args.record else None
    ids = list(args.deal or [])
    if not ids and record is not None:
        ids = sorted(set(record.deals.values()) | {r[2] for r in record.created})
    env = dict(os.environ)

    if args.api:
        token = args.admin_token or env.get("GATE_ADMIN_TOKEN")
        if not token:
            raise SystemExit("verify: --api needs --admin-token or GATE_ADMIN_TOKEN")
        deals = [
            await verify_api_deal(
                args.api.rstrip("/"),
                token,
                env.get("GATE_JWT_SECRET"),
                i,
                record,
                args.settle_seconds,
            )
            for i in ids
        ]
        return finish(deals, record)

    if args.baseline:
        from loadtest.baseline.store import baseline_url

        env["GATE_MYSQL_URL"] = baseline_url(env)
    # The verifier needs no secret; dev mode only fills the ones that are unset.
    settings = load_settings({**env, "GATE_ENV": "dev"})
    db = Database(settings, pool_max=4)
    await db.start()
    try:
        if not ids:
            ids = [int(r[0]) for r in await db.fetchall("SELECT id FROM deals ORDER BY id")]
        if args.baseline:
            deals = [await verify_baseline_deal(db, i, record) for i in ids]
            return finish(deals, record)
        from gate.store.redis_mode import detect_mode, make_redis

        # As `gate serve` makes it: on Redis Cluster a cluster client (a plain one is
        # told MOVED for every deal whose slot is not on the URL's node).
        mode = detect_mode(settings.redis_url, settings.redis_mode, 5.0)
        rds = make_redis(settings.redis_url, 4, 5.0, mode)
        try:
            deals = [await verify_gate_deal(db, rds, i, record, args.settle_seconds) for i in ids]
        finally:
            await rds.aclose()
        return finish(deals, record)
    finally:
        await db.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.verify",
        description="Verify a load-test run: invariants, Redis = DB, order states, client record.",
    )
    p.add_argument("--record", help="client record JSON written by the locust run")
    p.add_argument("--deal", type=int, action="append", help="deal id (repeatable)")
    p.add_argument("--baseline", action="store_true", help="verify the peer baseline's database")
    p.add_argument("--api", metavar="URL", help="verify a remote gate through its admin API")
    p.add_argument("--admin-token", help="admin token for --api (default GATE_ADMIN_TOKEN)")
    p.add_argument("--settle-seconds", type=float, default=15.0)
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except Exception as exc:
        # Cannot connect, cannot read the record…: no verdict, which is not a pass.
        print(f"verify: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        roles: dict[int, str] = {}
        if args.record:
            roles = {v: k for k, v in ClientRecord.read(Path(args.record)).deals.items()}
        print(render(report, roles))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
