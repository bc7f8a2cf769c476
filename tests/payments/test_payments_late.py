"""Late payments (success after the hold ended), refunds, events in any order."""

from __future__ import annotations

import itertools
import os
from typing import Any

import orjson
import redis.asyncio as aioredis

from gate.payments.workers import refund_key
from gate.store.db import Database
from tests import payments_support as ps
from tests.payments_support import (
    SandboxClient,
    event_body,
    new_order,
    order_row,
    post_webhook,
    signed,
    start_payment,
    wait_status,
    wait_until,
)
from tests.support import Client, assert_invariants, buyer, create_deal, reserve

# Fixtures shared by the payment modules (the shared conftest is the core's).
pay_client = ps.pay_client
sandbox = ps.sandbox
pay_stack = ps.pay_stack


async def _held_success(
    client: Client, sb: SandboxClient, deal: int, user: int, quantity: int = 1
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """An order paid at the provider whose callback the sandbox holds back."""
    order_id = await new_order(client, deal, user, quantity)
    session = await start_payment(client, order_id, user)
    await sb.configure(mode="hold")
    payment = await sb.pay(session["session_id"], "succeed")
    [event] = await sb.events(order_id, "payment.succeeded")
    return order_id, payment, event


async def _cancel(client: Client, order_id: str, user: int) -> None:
    r = await client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
    assert r.status_code == 200, r.text


async def test_late_payment_retakes_stock_when_some_is_left(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(
        pay_client, stock=4, buckets=2, unit_price=300, max_per_order=2, per_user_limit=2
    )
    order_id, payment, event = await _held_success(pay_client, sandbox, deal, 4201, 2)
    await _cancel(pay_client, order_id, 4201)  # the hold ends before the callback
    assert await sandbox.deliver([event["id"]]) == [[200]]

    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 600 and row["payment_id"] == payment["id"]
    late = await db.fetchall(
        "SELECT d_available, d_held, d_sold, op_id FROM inventory_ledger"
        " WHERE order_id = %s AND reason = 'late_pay'",
        (order_id,),
    )
    assert sum(int(r[0]) for r in late) == -2 and sum(int(r[2]) for r in late) == 2
    assert len({r[3] for r in late}) == 1  # one operation, one Redis intent id
    topics = await db.fetchall(
        "SELECT topic, payload FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
    )
    assert [t[0] for t in topics] == ["order.cancelled", "order.paid"]
    assert '"late":true' in topics[1][1]
    refunds = await db.fetchall("SELECT 1 FROM payment_refunds WHERE order_id = %s", (order_id,))
    assert refunds == []
    # Stock, ledger, quota and the Redis mirror all agree after the re-take.
    await assert_invariants(db, rds, deal)
    # A redelivery changes nothing.
    assert await sandbox.deliver([event["id"]]) == [[200]]
    assert (await order_row(db, order_id))["paid_amount"] == 600


async def test_late_payment_over_the_per_user_limit_is_refunded(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    """Limit 1: the buyer's order ends, they reserve again, then the first payment
    arrives. Stock is left, but a re-take would give them 2 units: refunded instead."""
    deal = await create_deal(pay_client, stock=5, unit_price=350, per_user_limit=1)
    order_id, _, event = await _held_success(pay_client, sandbox, deal, 4221)
    await _cancel(pay_client, order_id, 4221)  # the quota comes back with the unit
    again = await reserve(pay_client, deal, 4221, "late-over-limit-again")
    assert again.status_code == 201, again.text
    await sandbox.configure(mode="auto")
    assert await sandbox.deliver([event["id"]]) == [[200]]

    row = await wait_status(db, order_id, "REFUNDED")
    assert row["paid_amount"] == 350 and row["refunded_amount"] == 350
    stored = await db.fetchone(
        "SELECT reason FROM payment_refunds WHERE order_id = %s", (order_id,)
    )
    assert stored is not None and stored[0] == "late_over_limit"
    quota = await db.fetchone(
        "SELECT units FROM user_quota WHERE deal_id = %s AND user_id = %s", (deal, 4221)
    )
    assert quota is not None and int(quota[0]) == 1
    report = await assert_invariants(db, rds, deal)
    assert report["totals"]["held"] == 1 and report["totals"]["sold"] == 0


async def test_late_payment_without_stock_is_refunded_once(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=1, unit_price=450)
    order_id, payment, event = await _held_success(pay_client, sandbox, deal, 4211)
    await _cancel(pay_client, order_id, 4211)
    r = await reserve(pay_client, deal, 4212, "late-no-stock-other")
    assert r.status_code == 201  # somebody else holds the only unit now
    await sandbox.configure(mode="auto")
    assert await sandbox.deliver([event["id"]]) == [[200]]

    row = await wait_status(db, order_id, "REFUNDED")
    assert row["paid_amount"] == 450 and row["refunded_amount"] == 450
    refunds = await sandbox.refunds_of(payment["id"])
    assert [(r["amount"], r["status"]) for r in refunds] == [(450, "succeeded")]
    stored = await db.fetchone(
        "SELECT status, provider_refund_id, reason FROM payment_refunds WHERE order_id = %s",
        (order_id,),
    )
    assert stored is not None and tuple(stored) == ("succeeded", refunds[0]["id"], "late_no_stock")
    topics = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
    )
    assert [t[0] for t in topics] == ["order.cancelled", "order.refund_pending", "order.refunded"]
    await assert_invariants(db, rds, deal)

    # The refund is idempotent on retries: the gate's key gives back the same refund.
    key = refund_key("sandbox", payment["id"], 0)
    for _ in range(3):
        again = await sandbox.http.post(
            "/v1/refunds",
            json={"payment_id": payment["id"], "amount": 450},
            headers={"Idempotency-Key": key},
        )
        assert again.status_code == 200 and again.json()["id"] == refunds[0]["id"]
    # Never more than was paid: the provider refuses a new refund of the same payment...
    more = await sandbox.http.post(
        "/v1/refunds",
        json={"payment_id": payment["id"], "amount": 1},
        headers={"Idempotency-Key": "someone-else-0001"},
    )
    assert more.status_code == 409 and more.json()["code"] == "amount_exceeds_refundable"
    # ...and a refund the provider reports anyway is quarantined, not counted.
    forced = await sandbox.http.post(
        "/sandbox/seed/refund", json={"payment_id": payment["id"], "amount": 450, "force": True}
    )
    assert forced.status_code == 200

    async def quarantined() -> bool:
        rows = await db.fetchall(
            "SELECT outcome, detail FROM payment_events WHERE refund_id = %s",
            (forced.json()["id"],),
        )
        return [tuple(r) for r in rows] == [("quarantined", "unexpected_refund")]

    assert await wait_until(quarantined)
    row = await order_row(db, order_id)
    assert row["refunded_amount"] == 450 and row["status"] == "REFUNDED"
    assert len(await sandbox.refunds_of(payment["id"])) == 2  # the sandbox's, not ours


async def test_every_order_of_success_failure_refund_converges(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    perms = list(itertools.permutations(("succeeded", "failed", "refunded")))
    deal = await create_deal(pay_client, stock=len(perms), unit_price=250)
    cases = []
    for i, perm in enumerate(perms):
        user = 4300 + i
        order_id, payment, success = await _held_success(pay_client, sandbox, deal, user)
        await _cancel(pay_client, order_id, user)
        # The refund the gate will ask for exists already (same idempotency key): its
        # event can then arrive first, before the payment it returns.
        r = await sandbox.http.post(
            "/v1/refunds",
            json={"payment_id": payment["id"], "amount": 250},
            headers={"Idempotency-Key": refund_key("sandbox", payment["id"], 0)},
        )
        assert r.status_code == 200 and r.json()["status"] == "succeeded"
        [refund] = await sandbox.events(order_id, "refund.succeeded")
        # The provider reporting a failure of the same payment (a stale or buggy
        # event): it must change nothing, whenever it arrives.
        failure = event_body("payment.failed", order_id, payment["id"], 250)
        cases.append((perm, order_id, payment, success["id"], refund["id"], failure))
    for i in range(len(perms)):
        r = await reserve(pay_client, deal, 4400 + i, f"converge-other-{i:04d}")
        assert r.status_code == 201  # the deal is sold out: a late payment is refunded

    for perm, _order_id, _payment, success_id, refund_id, failure in cases:
        for step in perm:
            if step == "succeeded":
                assert await sandbox.deliver([success_id]) == [[200]]
            elif step == "refunded":
                assert await sandbox.deliver([refund_id]) == [[200]]
            else:
                resp = await post_webhook(pay_client, failure, signed(failure))
                assert resp.status_code == 200, resp.text

    await sandbox.configure(mode="auto")
    for perm, order_id, payment, *_ in cases:
        row = await wait_status(db, order_id, "REFUNDED")
        assert (row["paid_amount"], row["refunded_amount"]) == (250, 250), perm
        refunds = await sandbox.refunds_of(payment["id"])
        assert len(refunds) == 1, perm
        outbox = await db.fetchall(
            "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
        )
        assert [t[0] for t in outbox] == [
            "order.cancelled",
            "order.refund_pending",
            "order.refunded",
        ], perm
        waiting = await db.fetchall(
            "SELECT 1 FROM payment_events WHERE order_id = %s AND outcome IN ('waiting', 'late')",
            (order_id,),
        )
        assert waiting == [], perm
    await assert_invariants(db, rds, deal)


async def test_wrong_amount_currency_or_order_is_quarantined(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=3, unit_price=800)
    order_id = await new_order(pay_client, deal, 4501)
    await start_payment(pay_client, order_id, 4501)
    seeds = [
        {"order_id": order_id, "amount": 799, "currency": "EUR"},
        {"order_id": order_id, "amount": 800, "currency": "USD"},
        {"order_id": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "amount": 800, "currency": "EUR"},
        {"order_id": "not-an-order-of-ours", "amount": 800, "currency": "EUR"},
    ]
    event_ids = []
    for seed in seeds:
        r = await sandbox.http.post("/sandbox/seed/payment", json=seed)
        assert r.status_code == 200, r.text
        event_ids.append(r.json()["event_id"])

    async def all_recorded() -> bool:
        marks = ",".join(["%s"] * len(event_ids))
        rows = await db.fetchall(
            f"SELECT outcome FROM payment_events WHERE event_id IN ({marks})", tuple(event_ids)
        )
        return len(rows) == len(event_ids)

    assert await wait_until(all_recorded)
    marks = ",".join(["%s"] * len(event_ids))
    rows = await db.fetchall(
        f"SELECT event_id, outcome, detail FROM payment_events WHERE event_id IN ({marks})",
        tuple(event_ids),
    )
    details = {str(r[0]): (r[1], r[2]) for r in rows}
    assert [details[e] for e in event_ids] == [
        ("quarantined", "amount_mismatch"),
        ("quarantined", "currency_mismatch"),
        ("quarantined", "unknown_order"),
        ("quarantined", "unknown_order"),
    ]
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"
    alerts = await db.fetchall(
        "SELECT COUNT(*) FROM outbox WHERE topic = 'payment.quarantined' AND payload LIKE %s",
        (f"%{event_ids[0]}%",),
    )
    assert int(alerts[0][0]) == 1
    await assert_invariants(db, rds, deal)


async def test_second_payment_for_a_paid_order_is_refunded(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=2, unit_price=650)
    order_id = await new_order(pay_client, deal, 4601)
    session = await start_payment(pay_client, order_id, 4601)
    await sandbox.pay(session["session_id"], "succeed")
    await wait_status(db, order_id, "PAID")
    r = await sandbox.http.post(
        "/sandbox/seed/payment", json={"order_id": order_id, "amount": 650, "currency": "EUR"}
    )
    second = r.json()["id"]

    async def refunded() -> bool:
        return (await order_row(db, order_id))["refunded_amount"] == 650

    assert await wait_until(refunded)
    row = await order_row(db, order_id)
    assert (row["status"], row["paid_amount"], row["refunded_amount"]) == ("PAID", 1300, 650)
    assert [x["amount"] for x in await sandbox.refunds_of(second)] == [650]
    await assert_invariants(db, rds, deal)


async def test_declined_refunds_are_retried_until_settled(
    pay_client: Client, sandbox: SandboxClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(pay_client, stock=1, unit_price=220)
    order_id, payment, event = await _held_success(pay_client, sandbox, deal, 4801)
    await _cancel(pay_client, order_id, 4801)
    r = await reserve(pay_client, deal, 4802, "declined-refund-other")
    assert r.status_code == 201
    await sandbox.configure(mode="auto", refund_mode="fail")
    assert await sandbox.deliver([event["id"]]) == [[200]]

    async def declined() -> bool:
        return any(x["status"] == "failed" for x in await sandbox.refunds_of(payment["id"]))

    assert await wait_until(declined)
    assert (await order_row(db, order_id))["status"] == "REFUND_PENDING"
    await sandbox.configure(refund_mode="succeed")
    row = await wait_status(db, order_id, "REFUNDED", timeout_seconds=30)
    assert (row["paid_amount"], row["refunded_amount"]) == (220, 220)
    refunds = await sandbox.refunds_of(payment["id"])
    assert [x["status"] for x in refunds].count("succeeded") == 1
    assert sum(x["amount"] for x in refunds if x["status"] == "succeeded") == 220
    stored = await db.fetchone(
        "SELECT status, generation FROM payment_refunds WHERE order_id = %s", (order_id,)
    )
    assert stored is not None and stored[0] == "succeeded" and int(stored[1]) >= 1
    await assert_invariants(db, rds, deal)


async def _webhook(client: Client, body: bytes) -> dict[str, Any]:
    r = await post_webhook(client, body, signed(body))
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def _event_row(db: Database, event_id: str) -> tuple[str, str | None]:
    row = await db.fetchone(
        "SELECT outcome, detail FROM payment_events WHERE provider = 'sandbox' AND event_id = %s",
        (event_id,),
    )
    assert row is not None, event_id
    return str(row[0]), row[1]


async def test_event_payment_and_session_ids_differing_only_by_case_are_distinct(
    pay_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """Provider ids compare exactly, as at the provider (db/007): an event id differing
    only by case is not taken for a duplicate (losing the payment it carried), nor a
    payment id for another payment's row."""
    deal = await create_deal(pay_client, stock=3, unit_price=700)
    order_id = await new_order(pay_client, deal, 4901)
    tag = os.urandom(4).hex()
    # A failed attempt, then the success: event and payment ids differ only by case.
    failed = event_body(
        "payment.failed", order_id, f"pay_Case{tag}", 700, event_id=f"evt_Case{tag}"
    )
    assert (await _webhook(pay_client, failed))["outcome"] == "ignored"
    succeeded = event_body(
        "payment.succeeded", order_id, f"pay_case{tag}", 700, event_id=f"evt_case{tag}"
    )
    assert (await _webhook(pay_client, succeeded))["outcome"] == "applied"
    assert await _event_row(db, f"evt_Case{tag}") == ("ignored", "failed")
    assert await _event_row(db, f"evt_case{tag}") == ("applied", None)
    payments = await db.fetchall(
        "SELECT payment_id, status FROM payments WHERE order_id = %s ORDER BY status", (order_id,)
    )
    assert [tuple(r) for r in payments] == [
        (f"pay_Case{tag}", "failed"),
        (f"pay_case{tag}", "succeeded"),
    ]
    row = await order_row(db, order_id)
    assert (row["status"], row["paid_amount"]) == ("PAID", 700)
    assert row["payment_id"] == f"pay_case{tag}"
    # Looked up exactly: the other case finds nothing.
    assert (
        await db.fetchone("SELECT 1 FROM payment_events WHERE event_id = %s", (f"EVT_CASE{tag}",))
        is None
    )

    # Two sessions whose ids differ only by case are two sessions.
    other = await new_order(pay_client, deal, 4902)
    for oid, sid in ((order_id, f"cs_Sess{tag}"), (other, f"cs_sess{tag}")):
        await db.execute(
            "INSERT INTO payment_sessions (order_id, provider, session_id, redirect_url)"
            " VALUES (%s, 'sandbox', %s, 'http://127.0.0.1/pay')",
            (oid, sid),
        )
    found = await db.fetchall(
        "SELECT order_id FROM payment_sessions WHERE provider = 'sandbox' AND session_id = %s",
        (f"cs_sess{tag}",),
    )
    assert [str(r[0]) for r in found] == [other]
    await assert_invariants(db, rds, deal)


async def test_an_event_cannot_repoint_a_known_payment_or_change_its_amount(
    pay_client: Client, db: Database, rds: aioredis.Redis
) -> None:
    """A signed event naming a payment the gate holds with another
    order or another amount is quarantined, and nothing changes (gate_payment_event_in_tx):
    the success of order A's failed attempt named for order B does not pay B."""
    deal = await create_deal(pay_client, stock=4, unit_price=800)
    a = await new_order(pay_client, deal, 4911)
    b = await new_order(pay_client, deal, 4912)
    tag = os.urandom(4).hex()
    paid, attempt = f"pay_a{tag}", f"pay_f{tag}"
    assert (await _webhook(pay_client, event_body("payment.succeeded", a, paid, 800)))[
        "outcome"
    ] == "applied"
    # A failed attempt of A, with its amount (799: the provider's word for it).
    assert (await _webhook(pay_client, event_body("payment.failed", a, attempt, 799)))[
        "outcome"
    ] == "ignored"

    async def state() -> Any:
        orders = await db.fetchall(
            "SELECT id, status, paid_amount, refunded_amount, provider_payment_id, version"
            " FROM orders WHERE id IN (%s, %s) ORDER BY id",
            (a, b),
        )
        payments = await db.fetchall(
            "SELECT payment_id, order_id, amount, status, refunded_amount FROM payments"
            " WHERE payment_id IN (%s, %s) ORDER BY payment_id",
            (paid, attempt),
        )
        refunds = await db.fetchone(
            "SELECT COUNT(*) FROM payment_refunds WHERE order_id IN (%s, %s)", (a, b)
        )
        return [tuple(r) for r in orders], [tuple(r) for r in payments], refunds

    before = await state()
    cases = [
        # the paid payment named for another order: a second payment of B, or its capture
        ("payment.succeeded", b, paid, 800, "payment_order_changed"),
        ("payment.authorized", b, paid, 800, "payment_order_changed"),
        ("refund.succeeded", b, paid, 800, "payment_order_changed"),
        # A's failed attempt succeeding as B's payment
        ("payment.succeeded", b, attempt, 800, "payment_order_changed"),
        # A's failed attempt succeeding for A with another amount than it had
        ("payment.succeeded", a, attempt, 800, "payment_amount_changed"),
        # the paid payment with another amount (also not the order's)
        ("payment.succeeded", a, paid, 900, "payment_amount_changed"),
    ]
    for event_type, order_id, payment_id, amount, detail in cases:
        extra = {"refund_id": f"re_{tag}"} if event_type.startswith("refund") else {}
        body = event_body(event_type, order_id, payment_id, amount, **extra)
        answer = await _webhook(pay_client, body)
        assert answer["outcome"] == "quarantined", (event_type, order_id, payment_id, answer)
        event_id = str(orjson.loads(body)["id"])
        assert await _event_row(db, event_id) == ("quarantined", detail), event_type
        alerts = await db.fetchone(
            "SELECT COUNT(*) FROM outbox WHERE topic = 'payment.quarantined' AND payload LIKE %s",
            (f"%{event_id}%",),
        )
        assert alerts is not None and int(alerts[0]) == 1
    assert await state() == before
    assert (await order_row(db, b))["status"] == "PENDING_PAYMENT"
    await assert_invariants(db, rds, deal)
