"""Provider reconciliation: one divergence of each kind seeded in a real sandbox over
HTTP, repaired or flagged by one `gate reconcile` run; the second run is a no-op; the
periodic pass in `gate serve` repairs a dropped callback on its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gate.base.metrics import sample_values, value_of
from gate.inventory.orders import new_id
from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import (
    PayStack,
    SandboxClient,
    event_body,
    expire,
    new_order,
    order_row,
    signed,
    start_payment,
    wait_status,
    wait_until,
)
from tests.support import (
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    free_port,
    reserve,
)

core = ps.core
pay_client = ps.pay_client
sandbox = ps.sandbox

# A provider name of its own: other payment modules' rows in the shared test database
# belong to provider "sandbox" and stay out of this module's reconciliation.
PROVIDER = "sandbox-rec"
WEBHOOK = f"/v1/payments/{PROVIDER}/webhook"


# The gate under test does not reconcile by itself (the command does), and everything
# seeded is settled before a run: no grace period, every unsettled refund is stuck.
REC_ENV = {
    "GATE_PAYMENT_PROVIDER": PROVIDER,
    "GATE_RECONCILE_INTERVAL_SECONDS": "0",
    "GATE_RECONCILE_GRACE_SECONDS": "0",
    "GATE_RECONCILE_REFUND_STUCK_SECONDS": "0",
}


# The payment fixtures (pay_client, sandbox) run against this module's stack.
@pytest.fixture(scope="module")
def pay_stack(prepared: None) -> Iterator[PayStack]:
    with ps.running_pay_stack(REC_ENV, PROVIDER, workers=1) as stack:
        yield stack


async def quiet(sb: SandboxClient) -> None:
    """No callback of the sandbox still on its way."""

    async def idle() -> bool:
        stats = (await sb.http.get("/sandbox/stats")).json()
        return int(stats["in_flight"]) == 0

    assert await wait_until(idle)


async def seed_payment(sb: SandboxClient, **body: Any) -> dict[str, Any]:
    r = await sb.http.post("/sandbox/seed/payment", json=body)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


async def paid(
    client: Client, sb: SandboxClient, db: Database, deal: int, user: int
) -> tuple[str, str]:
    """An order paid the ordinary way: its id and the provider's payment id."""
    order_id = await new_order(client, deal, user)
    session = await start_payment(client, order_id, user)
    payment = await sb.pay(session["session_id"])
    await wait_status(db, order_id, "PAID")
    return order_id, str(payment["id"])


async def dropped(
    client: Client, sb: SandboxClient, order_id: str, user: int, outcome: str = "succeed"
) -> str:
    """Paid at the provider, its callback dropped; returns the payment id."""
    session = await start_payment(client, order_id, user)
    await sb.configure(drop_rate=1.0)
    payment = await sb.pay(session["session_id"], outcome)
    await sb.configure(drop_rate=0.0)
    return str(payment["id"])


async def cancel(client: Client, order_id: str, user: int) -> None:
    r = await client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
    assert r.status_code == 200, r.text


async def refund_row(db: Database, payment_id: str) -> tuple[Any, ...] | None:
    return await db.fetchone(
        "SELECT status, provider_refund_id FROM payment_refunds"
        " WHERE provider = %s AND payment_id = %s",
        (PROVIDER, payment_id),
    )


async def refund_settled(db: Database, payment_id: str) -> bool:
    row = await refund_row(db, payment_id)
    return row is not None and row[0] == "succeeded"


async def asked_refund(db: Database, payment_id: str) -> str:
    """Once the gate has asked the provider for this payment's refund: its id there."""

    async def asked() -> bool:
        row = await refund_row(db, payment_id)
        return row is not None and row[1] is not None

    assert await wait_until(asked)
    row = await refund_row(db, payment_id)
    assert row is not None
    return str(row[1])


async def settle_silently(sb: SandboxClient, refund_id: str, outcome: str) -> None:
    """The provider settles a pending refund and its callback is lost."""
    await sb.configure(drop_rate=1.0)
    r = await sb.http.post(f"/sandbox/refunds/{refund_id}/settle", json={"outcome": outcome})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == {"succeed": "succeeded", "fail": "failed"}[outcome]
    await sb.configure(drop_rate=0.0)


async def second_payment_settled_silently(
    sb: SandboxClient, db: Database, order_id: str, outcome: str
) -> tuple[str, str]:
    """A second payment for a paid order, announced: the gate asks for its refund,
    which the provider settles with `outcome` without telling the gate. Returns the
    payment's and the refund's ids."""
    await sb.configure(refund_mode="pending")
    payment = await seed_payment(sb, order_id=order_id, amount=500, currency="EUR")
    refund_id = await asked_refund(db, str(payment["id"]))
    await sb.configure(refund_mode="succeed")
    await settle_silently(sb, refund_id, outcome)
    return str(payment["id"]), refund_id


async def totals(db: Database, sb: SandboxClient) -> dict[str, int]:
    """Row counts a repair would change (and the orders' versions)."""
    out: dict[str, int] = {}
    for table in ("payment_events", "outbox", "payments", "payment_refunds", "inventory_ledger"):
        row = await db.fetchone(f"SELECT COUNT(*) FROM {table}")
        out[table] = int(row[0]) if row else 0
    row = await db.fetchone("SELECT COALESCE(SUM(version), 0) FROM orders")
    out["order_versions"] = int(row[0]) if row else 0
    out["provider_transactions"] = len(await sb.transactions())
    return out


def by_payment(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["payment_id"]: f for f in report["findings"]}


async def test_one_run_repairs_or_flags_each_kind_and_a_second_run_is_a_no_op(
    pay_stack: PayStack,
    pay_client: Client,
    sandbox: SandboxClient,
    db: Database,
    rds: aioredis.Redis,
    core: Any,
) -> None:
    client, sb = pay_client, sandbox
    deal = await create_deal(client, stock=20, buckets=2, unit_price=500)
    deal_c = await create_deal(client, stock=1, unit_price=450)
    deal_e = await create_deal(client, stock=1, unit_price=700)

    # paid_not_applied: paid at the provider, the callback dropped, still pending here.
    order_a = await new_order(client, deal, 6101)
    pay_a = await dropped(client, sb, order_a, 6101)
    # ... the same, and the hold expired meanwhile: a late payment, stock re-taken.
    order_b = await new_order(client, deal, 6102)
    pay_b = await dropped(client, sb, order_b, 6102)
    await expire(core, order_b)
    # ... cancelled, and somebody else holds the only unit now: refunded.
    order_c = await new_order(client, deal_c, 6103)
    session_c = await start_payment(client, order_c, 6103)
    await cancel(client, order_c, 6103)
    assert (await reserve(client, deal_c, 6104, "rec-c-other")).status_code == 201
    await sb.configure(drop_rate=1.0)
    pay_c = str((await sb.pay(session_c["session_id"]))["id"])
    await sb.configure(drop_rate=0.0)

    # paid_without_payment: a signed callback for a payment the provider never made.
    order_d = await new_order(client, deal, 6105)
    pay_d = f"pi_forged_{os.urandom(6).hex()}"
    body = event_body("payment.succeeded", order_d, pay_d, 500)
    r = await client.post(WEBHOOK, content=body, headers=signed(body))
    assert r.status_code == 200, r.text
    await wait_status(db, order_d, "PAID")

    # refund_stuck: a late payment without stock whose refund stays pending at the
    # provider (REFUND_PENDING here).
    order_e = await new_order(client, deal_e, 6106)
    session_e = await start_payment(client, order_e, 6106)
    await cancel(client, order_e, 6106)
    assert (await reserve(client, deal_e, 6107, "rec-e-other")).status_code == 201
    await sb.configure(refund_mode="pending")
    pay_e = str((await sb.pay(session_e["session_id"]))["id"])
    await wait_status(db, order_e, "REFUND_PENDING")

    await asked_refund(db, pay_e)

    # missing_event: a second payment's refund settled at the provider, its callback
    # dropped (the gate still waits for it).
    order_e2, _ = await paid(client, sb, db, deal, 6108)
    pay_e2, refund_e2 = await second_payment_settled_silently(sb, db, order_e2, "succeed")
    # missing_event: the same, declined at the provider: the next generation is asked for.
    order_e3, _ = await paid(client, sb, db, deal, 6114)
    pay_e3, refund_e3 = await second_payment_settled_silently(sb, db, order_e3, "fail")

    # second_payment: a second successful payment for a paid order, never announced.
    order_f, _ = await paid(client, sb, db, deal, 6109)
    pay_f2 = str(
        (await seed_payment(sb, order_id=order_f, amount=500, currency="EUR", emit=False))["id"]
    )

    # amount_mismatch: a wrong amount never announced; a wrong currency whose callback
    # came and was quarantined.
    order_g = await new_order(client, deal, 6110)
    pay_g = str(
        (await seed_payment(sb, order_id=order_g, amount=499, currency="EUR", emit=False))["id"]
    )
    order_g2 = await new_order(client, deal, 6111)
    pay_g2 = str((await seed_payment(sb, order_id=order_g2, amount=500, currency="USD"))["id"])
    # unknown_order: a payment naming an order this gate never issued.
    pay_u = str(
        (await seed_payment(sb, order_id=new_id(), amount=500, currency="EUR", emit=False))["id"]
    )

    # duplicate_event: one fact delivered under a second event id.
    order_j, pay_j = await paid(client, sb, db, deal, 6112)
    again = event_body("payment.succeeded", order_j, pay_j, 500)
    r = await client.post(WEBHOOK, content=again, headers=signed(again))
    assert r.status_code == 200, r.text

    # missing_event: a failed attempt whose callback was dropped.
    order_m = await new_order(client, deal, 6113)
    pay_m = await dropped(client, sb, order_m, 6113, "fail")

    await quiet(sb)
    assert (await order_row(db, order_a))["status"] == "PENDING_PAYMENT"
    assert (await order_row(db, order_b))["status"] == "EXPIRED"
    assert (await order_row(db, order_c))["status"] == "CANCELLED"

    # -- the first run -------------------------------------------------------------------
    code, report = await ps.reconcile(pay_stack.env)
    assert code == 1, report
    assert report["result"] == "flagged"
    found = by_payment(report)

    def expect(payment_id: str, kind: str, outcomes: set[str]) -> dict[str, Any]:
        f = found.get(payment_id)
        assert f is not None, (payment_id, kind, report["findings"])
        assert f["kind"] == kind and f["outcome"] in outcomes and f["new"], f
        return f

    expect(pay_a, "paid_not_applied", {"repaired"})
    assert "late" in expect(pay_b, "paid_not_applied", {"repaired"})["detail"]
    expect(pay_c, "paid_not_applied", {"refunded", "refund_scheduled"})
    expect(pay_d, "paid_without_payment", {"flagged"})
    expect(pay_e, "refund_stuck", {"flagged"})
    f_e2 = expect(pay_e2, "missing_event", {"repaired"})
    assert f_e2["refund_id"] == refund_e2
    f_e3 = expect(pay_e3, "missing_event", {"repaired"})
    assert f_e3["refund_id"] == refund_e3 and "refund_retry" in f_e3["detail"]
    expect(pay_f2, "second_payment", {"refunded", "refund_scheduled"})
    assert expect(pay_g, "amount_mismatch", {"flagged"})["detail"] == "amount_mismatch"
    assert expect(pay_g2, "amount_mismatch", {"flagged"})["detail"] == "currency_mismatch"
    expect(pay_u, "unknown_order", {"flagged"})
    expect(pay_j, "duplicate_event", {"reported"})
    expect(pay_m, "missing_event", {"repaired"})
    assert found[pay_a]["needs_operator"] is False and found[pay_d]["needs_operator"] is True

    # Paid here now, through the same state machine as a callback.
    row_a = await order_row(db, order_a)
    assert row_a["status"] == "PAID" and row_a["paid_amount"] == 500
    assert row_a["payment_id"] == pay_a
    event = await db.fetchone(
        "SELECT outcome, payload FROM payment_events WHERE provider = %s AND event_id = %s",
        (PROVIDER, f"api:{pay_a}:succeeded"),
    )
    assert event is not None and event[0] == "applied"
    assert orjson.loads(event[1])["source"] == "reconcile"
    topics = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_a,)
    )
    assert [t[0] for t in topics] == ["order.paid"]
    ledger = await db.fetchall(
        "SELECT reason, d_held, d_sold FROM inventory_ledger"
        " WHERE order_id = %s AND reason = 'pay'",
        (order_a,),
    )
    assert sum(int(r[2]) for r in ledger) == 1 and sum(int(r[1]) for r in ledger) == -1
    # Late: the units taken again, ledgered.
    assert (await order_row(db, order_b))["status"] == "PAID"
    late = await db.fetchall(
        "SELECT d_available, d_sold FROM inventory_ledger WHERE order_id = %s"
        " AND reason = 'late_pay'",
        (order_b,),
    )
    assert sum(int(r[0]) for r in late) == -1 and sum(int(r[1]) for r in late) == 1
    # Late without stock: the money went back, once.
    row_c = await wait_status(db, order_c, "REFUNDED")
    assert row_c["paid_amount"] == row_c["refunded_amount"] == 450
    assert [(x["amount"], x["status"]) for x in await sb.refunds_of(pay_c)] == [(450, "succeeded")]
    # Never un-paid: flagged for an operator, with one outbox row saying so.
    assert (await order_row(db, order_d))["status"] == "PAID"
    flags = await db.fetchall(
        "SELECT payload FROM outbox"
        " WHERE aggregate_id = %s AND topic = 'payment.reconcile_flagged'",
        (order_d,),
    )
    assert len(flags) == 1 and orjson.loads(flags[0][0])["kind"] == "paid_without_payment"
    # The stuck refund was asked again with its stable key: still one refund there.
    assert (await order_row(db, order_e))["status"] == "REFUND_PENDING"
    assert [x["status"] for x in await sb.refunds_of(pay_e)] == ["pending"]
    # The settled refund's dropped callback, applied from the provider's listing.
    assert await refund_settled(db, pay_e2)
    row_e2 = await order_row(db, order_e2)
    assert (row_e2["status"], row_e2["paid_amount"], row_e2["refunded_amount"]) == (
        "PAID",
        1000,
        500,
    )
    # The declined refund asked again under the next generation's key, and settled.
    assert await wait_until(lambda: refund_settled(db, pay_e3))
    assert [x["status"] for x in await sb.refunds_of(pay_e3)] == ["failed", "succeeded"]
    row_e3 = await order_row(db, order_e3)
    assert (row_e3["paid_amount"], row_e3["refunded_amount"]) == (1000, 500)
    # The second payment refunded through the second-payment path, once.
    assert await wait_until(lambda: refund_settled(db, pay_f2))
    row_f = await order_row(db, order_f)
    assert (row_f["status"], row_f["paid_amount"], row_f["refunded_amount"]) == ("PAID", 1000, 500)
    assert [(x["amount"], x["status"]) for x in await sb.refunds_of(pay_f2)] == [(500, "succeeded")]
    f_topics = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_f,)
    )
    assert [t[0] for t in f_topics] == ["order.paid", "payment.refund_scheduled"]
    # Mismatches are quarantined, never PAID.
    for order_id, pay in ((order_g, pay_g), (order_g2, pay_g2)):
        assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"
        q = await db.fetchall(
            "SELECT outcome FROM payment_events WHERE provider = %s AND payment_id = %s",
            (PROVIDER, pay),
        )
        assert [x[0] for x in q] == ["quarantined"]
    # The dropped failure is recorded; the order may still be paid.
    failed = await db.fetchone(
        "SELECT status FROM payments WHERE provider = %s AND payment_id = %s", (PROVIDER, pay_m)
    )
    assert failed is not None and failed[0] == "failed"
    assert (await order_row(db, order_m))["status"] == "PENDING_PAYMENT"
    for d in (deal, deal_c, deal_e):
        await assert_invariants(db, rds, d)

    # -- the second run: nothing new, no new rows ----------------------------------------
    await quiet(sb)
    before = await totals(db, sb)
    code, second = await ps.reconcile(pay_stack.env)
    assert code == 1, second  # the flagged cases still need an operator
    assert second["new"] == 0, second["findings"]
    assert all(not f["new"] for f in second["findings"])
    assert {f["payment_id"] for f in second["findings"] if f["needs_operator"]} >= {
        pay_d,
        pay_e,
        pay_g,
        pay_g2,
        pay_u,
    }
    assert pay_j not in by_payment(second)  # reported once
    assert await totals(db, sb) == before
    for d in (deal, deal_c, deal_e):
        await assert_invariants(db, rds, d)

    # -- the stuck refund settles at the provider, its callback lost: repaired ---------
    refund_e = str((await sb.refunds_of(pay_e))[0]["id"])
    await settle_silently(sb, refund_e, "succeed")
    code, third = await ps.reconcile(pay_stack.env)
    assert code == 1
    assert [(f["kind"], f["outcome"], f["payment_id"]) for f in third["findings"] if f["new"]] == [
        ("missing_event", "repaired", pay_e)
    ]
    row_e = await order_row(db, order_e)
    assert (row_e["status"], row_e["refunded_amount"]) == ("REFUNDED", 700)
    # No longer stuck: the open findings are the other flagged ones.
    assert pay_e not in {f["payment_id"] for f in third["findings"] if not f["new"]}


async def test_provider_unreachable_exits_2(pay_stack: PayStack) -> None:
    env = {**pay_stack.env, "GATE_PAYMENT_PROVIDER_URL": f"http://127.0.0.1:{free_port()}"}
    code, report = await ps.reconcile(env)
    assert code == 2
    assert report["result"] == "unavailable" and "transaction listing" in report["error"]


async def test_the_periodic_pass_repairs_a_dropped_callback(
    pay_stack: PayStack, pay_client: Client, sandbox: SandboxClient, db: Database
) -> None:
    client, sb = pay_client, sandbox
    env = {**pay_stack.env, "GATE_RECONCILE_INTERVAL_SECONDS": "0.3"}
    periodic = GateProcess(env, workers=1)
    try:
        periodic.wait_ready()
        deal = await create_deal(client, stock=3, unit_price=500)
        order_id = await new_order(client, deal, 6201)
        payment_id = await dropped(client, sb, order_id, 6201)
        row = await wait_status(db, order_id, "PAID", timeout_seconds=30)
        assert row["payment_id"] == payment_id
        event = await db.fetchone(
            "SELECT outcome FROM payment_events WHERE provider = %s AND event_id = %s",
            (PROVIDER, f"api:{payment_id}:succeeded"),
        )
        assert event is not None and event[0] == "applied"
        # The pass counts its findings when it ends (the order is PAID before that).
        metrics = Client(periodic.url)
        try:

            async def counted() -> bool:
                text = await metrics.metrics()
                repaired = value_of(
                    sample_values(text),
                    "gate_reconcile_findings_total",
                    kind="paid_not_applied",
                    outcome="repaired",
                )
                return repaired >= 1

            assert await wait_until(counted, timeout_seconds=30)
        finally:
            await metrics.close()
    finally:
        periodic.stop()


async def test_a_pass_over_its_action_budget_defers_the_rest_and_exits_2(
    pay_stack: PayStack, pay_client: Client, sandbox: SandboxClient, db: Database
) -> None:
    client, sb = pay_client, sandbox
    deal = await create_deal(client, stock=5, unit_price=500)
    orders = []
    for user in (6301, 6302, 6303):
        order_id = await new_order(client, deal, user)
        orders.append((order_id, await dropped(client, sb, order_id, user)))
    await quiet(sb)
    # One repair allowed: the other dropped callbacks wait for the next pass, which
    # the report and the exit status must say (exit 0 would read "all repaired").
    code, report = await ps.reconcile({**pay_stack.env, "GATE_RECONCILE_ACTIONS_MAX": "1"})
    assert code == 2, report
    assert report["result"] == "incomplete"
    mine = [f for f in report["findings"] if f["order_id"] in {o for o, _ in orders}]
    assert sorted(f["outcome"] for f in mine) == ["deferred", "deferred", "repaired"], mine
    # The next pass, with room, repairs what was deferred.
    code, report = await ps.reconcile(pay_stack.env)
    assert report["result"] != "incomplete", report
    for order_id, payment_id in orders:
        row = await order_row(db, order_id)
        assert (row["status"], row["payment_id"]) == ("PAID", payment_id)
