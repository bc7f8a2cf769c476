"""End to end over HTTP: reserve -> payment session -> pay in the sandbox -> signed
callback -> PAID; authorize -> capture -> PAID; authorize -> hold ends -> void."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from gate.payments.config import load_payment_settings
from gate.payments.providers.http import SandboxProvider
from gate.runtime import Gate
from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import (
    SandboxClient,
    expire,
    new_order,
    order_row,
    start_payment,
    wait_status,
    wait_until,
)
from tests.support import Client, assert_invariants, buyer, create_deal

# Fixtures shared by the payment modules (the shared conftest is the core's).
core = ps.core
pay_client = ps.pay_client
sandbox = ps.sandbox
pay_stack = ps.pay_stack


async def test_full_flow_reserve_pay_callback_paid(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=5, buckets=2, unit_price=700)
    order_id = await new_order(pay_client, deal, 4001)

    session = await start_payment(pay_client, order_id, 4001)
    assert session["provider"] == "sandbox"
    assert session["session_id"].startswith("cs_")
    assert session["redirect_url"].endswith("/pay/" + session["session_id"])
    assert session["expires_at"].endswith("Z")
    # Idempotent: the same session again, 200 instead of 201.
    again = await pay_client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4001))
    assert again.status_code == 200 and again.json() == session
    # Another buyer cannot see or pay it.
    other = await pay_client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4002))
    assert other.status_code == 404

    payment = await sandbox.pay(session["session_id"], "succeed")
    assert payment["status"] == "succeeded"

    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 700 and row["payment_id"] == payment["id"]
    view = await pay_client.get(f"/v1/orders/{order_id}", headers=buyer(4001))
    assert view.json()["status"] == "PAID" and view.json()["paid_at"]

    # held -> sold on the order's bucket, ledgered, no change to available.
    ledger = await db.fetchall(
        "SELECT d_available, d_held, d_sold, reason FROM inventory_ledger WHERE order_id = %s"
        " ORDER BY id",
        (order_id,),
    )
    assert [tuple(r) for r in ledger] == [(-1, 1, 0, "reserve"), (0, -1, 1, "pay")]
    outbox = await db.fetchall("SELECT topic FROM outbox WHERE aggregate_id = %s", (order_id,))
    assert [r[0] for r in outbox] == ["order.paid"]
    events = await db.fetchall(
        "SELECT event_type, outcome FROM payment_events WHERE order_id = %s", (order_id,)
    )
    assert [tuple(r) for r in events] == [("payment.succeeded", "applied")]
    report = await assert_invariants(db, rds, deal)
    assert report["invariant"]["ok"]

    # A paid order cannot get its session again (nothing is left to pay); cancelling
    # it is a conflict.
    after = await pay_client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4001))
    assert after.status_code == 409, after.text
    assert after.json()["code"] == "CONFLICT" and after.json()["order_status"] == "PAID"
    # RFC 9457's status is the HTTP status (it carried the order's status before).
    assert after.json()["status"] == 409
    cancel = await pay_client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(4001))
    assert cancel.status_code == 409
    assert cancel.json()["status"] == 409 and cancel.json()["order_status"] == "PAID"


async def test_concurrent_first_session_requests_share_one_session_and_one_201(
    pay_client: Client,
) -> None:
    deal = await create_deal(pay_client, stock=2)
    order_id = await new_order(pay_client, deal, 4091)
    answers = await asyncio.gather(
        *(pay_client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4091)) for _ in range(6))
    )
    assert sorted(r.status_code for r in answers) == [200] * 5 + [201], [a.text for a in answers]
    assert len({r.json()["session_id"] for r in answers}) == 1


async def test_payment_session_refused_outside_the_hold(
    pay_client: Client, sandbox: SandboxClient, db: Database
) -> None:
    deal = await create_deal(pay_client, stock=2)
    order_id = await new_order(pay_client, deal, 4011)
    r = await pay_client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(4011))
    assert r.status_code == 200
    r = await pay_client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4011))
    assert r.status_code == 409 and r.json()["code"] == "CONFLICT"
    r = await pay_client.post("/v1/orders/01ARZ3NDEKTSV4RRFFQ69G5FAV/payment", headers=buyer(4011))
    assert r.status_code == 404
    r = await pay_client.post(f"/v1/orders/{order_id}/payment")
    assert r.status_code == 401
    rows = await db.fetchall("SELECT 1 FROM payment_sessions WHERE order_id = %s", (order_id,))
    assert rows == []


async def test_session_creation_that_times_out_is_resolved_by_query(
    pay_client: Client, sandbox: SandboxClient, db: Database
) -> None:
    deal = await create_deal(pay_client, stock=2)
    order_id = await new_order(pay_client, deal, 4021)
    # The sandbox creates the session, then answers after the gate's 1 s timeout; the
    # gate asks for the order's session instead of assuming a failure.
    await sandbox.configure(session_delay_seconds=3.0)
    session = await start_payment(pay_client, order_id, 4021)
    await sandbox.configure(session_delay_seconds=0.0)
    listed = await sandbox.http.get(f"/v1/sessions?order_id={order_id}")
    sessions = listed.json()["data"]
    assert len(sessions) == 1 and sessions[0]["id"] == session["session_id"]


async def test_authorize_then_capture(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(
        pay_client, stock=3, unit_price=900, capture_mode="manual", hold_seconds=600
    )
    order_id = await new_order(pay_client, deal, 4031)
    session = await start_payment(pay_client, order_id, 4031)
    payment = await sandbox.pay(session["session_id"], "succeed")
    # A manual-capture session only authorizes; the gate captures while the hold is valid.
    assert payment["status"] == "authorized"
    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 900
    captured = await sandbox.payments(order_id)
    assert [(p["status"], p["captured_amount"]) for p in captured] == [("succeeded", 900)]
    outbox = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
    )
    assert [r[0] for r in outbox] == ["order.authorized", "order.paid"]
    await assert_invariants(db, rds, deal)


async def test_authorization_voided_when_the_hold_ended(
    pay_client: Client,
    sandbox: SandboxClient,
    db: Database,
    rds: aioredis.Redis,
    core: Gate,
) -> None:
    deal = await create_deal(pay_client, stock=3, unit_price=900, capture_mode="manual")
    order_id = await new_order(pay_client, deal, 4041)
    session = await start_payment(pay_client, order_id, 4041)
    # The hold is too close to its end to capture (margin 5 s): AUTHORIZED keeps the
    # hold, the sweeper ends it, and the gate voids: the buyer is never charged.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 2 SECOND WHERE id = %s", (order_id,)
    )
    await sandbox.pay(session["session_id"], "succeed")
    await wait_status(db, order_id, "AUTHORIZED")
    await expire(core, order_id)
    assert (await order_row(db, order_id))["status"] == "EXPIRED"

    async def voided() -> bool:
        payments = await sandbox.payments(order_id)
        return [p["status"] for p in payments] == ["voided"]

    assert await wait_until(voided)
    payments = await sandbox.payments(order_id)
    assert payments[0]["captured_amount"] == 0
    row = await order_row(db, order_id)
    assert row["status"] == "EXPIRED" and row["paid_amount"] == 0

    async def recorded_voided() -> bool:
        row = await db.fetchone(
            "SELECT status FROM payments WHERE payment_id = %s", (payments[0]["id"],)
        )
        return row is not None and row[0] == "voided"

    assert await wait_until(recorded_voided)
    await assert_invariants(db, rds, deal)


async def test_without_a_provider_payments_answer_503(client: Client) -> None:
    # The suite's core gate has no provider configured: it runs, nobody can pay.
    deal = await create_deal(client, stock=1)
    order_id = await new_order(client, deal, 4051)
    r = await client.post(f"/v1/orders/{order_id}/payment", headers=buyer(4051))
    assert r.status_code == 503 and r.json()["code"] == "OVERLOADED"
    assert "Retry-After" in r.headers


async def test_provider_interface_lists_transactions_and_queries_by_order(
    pay_client: Client, sandbox: SandboxClient, pay_stack: ps.PayStack, db: Database
) -> None:
    deal = await create_deal(pay_client, stock=2, unit_price=333)
    order_id = await new_order(pay_client, deal, 4061)
    session = await start_payment(pay_client, order_id, 4061)
    paid = await sandbox.pay(session["session_id"], "succeed")
    await wait_status(db, order_id, "PAID")
    settings = load_payment_settings(pay_stack.env)
    provider = SandboxProvider(settings, [])
    try:
        found = await provider.find_session(order_id)
        assert found is not None and found.session_id == session["session_id"]
        [payment] = await provider.payments_for_order(order_id)
        assert (payment.payment_id, payment.status, payment.amount) == (
            paid["id"],
            "succeeded",
            333,
        )
        seen = []
        cursor = None
        while True:
            page = await provider.transactions(cursor, 50)
            seen.extend(page.items)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert [t.kind for t in seen if t.payment_id == paid["id"]] == ["payment"]
        assert await provider.get_payment("pi_does_not_exist") is None
    finally:
        await provider.close()
    metrics = await pay_client.metrics()
    for name in (
        "gate_callbacks_total",
        "gate_callback_delay_seconds",
        "gate_payment_quarantined_total",
        "gate_refund_backlog",
        "gate_outbox_unpublished",
        "gate_outbox_lag_seconds",
    ):
        assert name in metrics, name
