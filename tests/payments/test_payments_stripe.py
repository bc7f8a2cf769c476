"""Stripe end to end: a real gate with GATE_PAYMENT_PROVIDER=stripe, a
local fake of Stripe's API (tests/fake_stripe.py, its own process on loopback), real
Redis and MariaDB. Sessions, signed deliveries, authorize/capture/void, a late
payment refunded with the refund's notification, refused notifications, duplicates,
and `gate reconcile` repairing a dropped notification."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import stripe

from gate.base.settings import Secret, load_settings
from gate.payments.adapters import load_adapter
from gate.payments.config import load_payment_settings
from gate.payments.provider import ProviderRejected, ProviderUnavailable, SessionRequest
from gate.payments.providers.provider_http import RETRY_AFTER_MAX_SECONDS
from gate.payments.providers.stripe import (
    API_VERSION,
    COMPATIBLE_API_VERSIONS,
    StripeProvider,
    StripeWebhook,
)
from gate.runtime import Gate
from gate.store.db import Database
from tests import payments_support as ps
from tests.fake_stripe import signature
from tests.payments_support import (
    counts,
    expire,
    new_order,
    order_row,
    start_payment,
    wait_status,
    wait_until,
)
from tests.support import (
    ROOT,
    Client,
    GateProcess,
    Resp,
    ServerProcess,
    assert_invariants,
    buyer,
    create_deal,
    free_port,
    reserve,
    serve_once,
)

core = ps.core

STRIPE_KEY = "sk_test_fake0123456789abcdefghij"
STRIPE_SECRET = "whsec_fakeStripeEndpointSecret0123456789"
OTHER_SECRET = "whsec_someoneElsesEndpointSecret012345678"
WEBHOOK = "/v1/payments/stripe/webhook"


def fake_stripe_process(port: int, webhook_url: str) -> ServerProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATE_")}
    env.update(
        FAKE_STRIPE_API_KEY=STRIPE_KEY,
        FAKE_STRIPE_WEBHOOK_SECRET=STRIPE_SECRET,
        FAKE_STRIPE_WEBHOOK_URL=webhook_url,
    )
    args = [sys.executable, "-m", "tests.fake_stripe", "--port", str(port)]
    return ServerProcess("fake-stripe", args, env, port)


def stripe_env(api_base: str) -> dict[str, str]:
    env = ps.pay_env(api_base)
    for name in ("GATE_PAYMENT_PROVIDER_URL", "GATE_PAYMENT_API_KEY"):
        env.pop(name)
    env.update(
        {
            "GATE_PAYMENT_PROVIDER": "stripe",
            "GATE_STRIPE_API_KEY": STRIPE_KEY,
            "GATE_STRIPE_WEBHOOK_SECRET": STRIPE_SECRET,
            "GATE_STRIPE_API_BASE": api_base,
            "GATE_RECONCILE_GRACE_SECONDS": "0",
        }
    )
    return env


@dataclass
class StripeStack:
    gate: GateProcess
    fake: ServerProcess
    env: dict[str, str]


@pytest.fixture(scope="module")
def stack(prepared: None) -> Iterator[StripeStack]:
    port = free_port()
    env = stripe_env(f"http://127.0.0.1:{port}")
    with (
        GateProcess(env, workers=1) as gate,
        fake_stripe_process(port, gate.url + WEBHOOK) as fake,
    ):
        yield StripeStack(gate, fake, env)


class FakeClient:
    def __init__(self, url: str) -> None:
        self.http = Client(url)
        self.api = {"Authorization": f"Bearer {STRIPE_KEY}", "Stripe-Version": API_VERSION}

    async def _ok(self, method: str, path: str, body: Any = None) -> Any:
        r = await self.http.request(method, path, json=body)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    async def configure(self, **config: Any) -> None:
        await self._ok("POST", "/fake/config", config)

    async def pay(self, session_id: str, outcome: str = "succeed") -> dict[str, Any]:
        doc: dict[str, Any] = await self._ok(
            "POST", f"/fake/checkout/{session_id}", {"outcome": outcome}
        )
        return doc

    async def events(self, order_id: str, event_type: str | None = None) -> list[dict[str, Any]]:
        path = f"/fake/events?order_id={order_id}" + (f"&type={event_type}" if event_type else "")
        return list((await self._ok("GET", path))["data"])

    async def deliver(self, event_ids: list[str], copies: int = 1) -> list[list[int]]:
        doc = await self._ok("POST", "/fake/deliver", {"event_ids": event_ids, "copies": copies})
        return list(doc["statuses"])

    async def arrivals(self, path: str) -> list[dict[str, Any]]:
        return list((await self._ok("GET", f"/fake/arrivals?path={path}"))["data"])

    async def intent(self, payment_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/payment_intents/{payment_id}", headers=self.api)
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc

    async def refunds(self) -> list[dict[str, Any]]:
        r = await self.http.get("/v1/refunds?limit=100", headers=self.api)
        assert r.status_code == 200, r.text
        return list(r.json()["data"])


@pytest.fixture
async def gate_client(stack: StripeStack) -> AsyncIterator[Client]:
    async with Client(stack.gate.url) as c:
        yield c


@pytest.fixture
async def fake(stack: StripeStack) -> AsyncIterator[FakeClient]:
    f = FakeClient(stack.fake.url)
    reset = {
        "hold": False,
        "drop": False,
        "refund_mode": "succeed",
        "sign_with": None,
        "event_api_version": API_VERSION,
    }
    await f.configure(**reset)
    try:
        yield f
    finally:
        await f.configure(**reset)
        await f.http.close()


async def events_of(db: Database, order_id: str) -> list[tuple[str, str]]:
    rows = await db.fetchall(
        "SELECT event_type, outcome FROM payment_events WHERE order_id = %s"
        " ORDER BY received_at, event_id",
        (order_id,),
    )
    return [(str(r[0]), str(r[1])) for r in rows]


async def test_reserve_session_pay_notification_paid(
    gate_client: Client, fake: FakeClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(gate_client, stock=5, unit_price=1250, currency="EUR")
    order_id = await new_order(gate_client, deal, 6001)
    session = await start_payment(gate_client, order_id, 6001)
    assert session["provider"] == "stripe"
    assert session["session_id"].startswith("cs_test_")
    assert "/fake/checkout/" in session["redirect_url"]
    paid = await fake.pay(session["session_id"])
    pi = paid["payment_intent"]
    # What the gate asked Stripe for: the order in the PaymentIntent's metadata.
    assert pi["metadata"] == {"order_id": order_id}
    assert (pi["amount"], pi["currency"], pi["capture_method"]) == (1250, "eur", "automatic")
    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 1250 and row["payment_id"] == pi["id"]
    assert await events_of(db, order_id) == [("payment.succeeded", "applied")]
    outbox = await db.fetchall("SELECT topic FROM outbox WHERE aggregate_id = %s", (order_id,))
    assert [r[0] for r in outbox] == ["order.paid"]
    [event] = await fake.events(order_id, "payment_intent.succeeded")
    assert event["deliveries"] == [200]
    assert (await assert_invariants(db, rds, deal))["invariant"]["ok"]


async def test_a_failed_payment_is_recorded_and_the_order_stays_payable(
    gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=5, unit_price=800)
    order_id = await new_order(gate_client, deal, 6011)
    session = await start_payment(gate_client, order_id, 6011)
    first = await fake.pay(session["session_id"], "fail")

    async def recorded() -> bool:
        return bool(await events_of(db, order_id))

    assert await wait_until(recorded)
    # Recorded, no effect on a held order (as with the sandbox): the buyer may retry.
    assert await events_of(db, order_id) == [("payment.failed", "ignored")]
    row = await order_row(db, order_id)
    assert row["status"] == "PENDING_PAYMENT" and row["paid_amount"] == 0
    # Checkout confirms the same PaymentIntent again: failed, then succeeded.
    second = await fake.pay(session["session_id"])
    assert second["payment_intent"]["id"] == first["payment_intent"]["id"]
    row = await wait_status(db, order_id, "PAID")
    assert row["payment_id"] == second["payment_intent"]["id"] and row["paid_amount"] == 800
    assert await events_of(db, order_id) == [
        ("payment.failed", "ignored"),
        ("payment.succeeded", "applied"),
    ]


async def test_authorize_then_capture(
    gate_client: Client, fake: FakeClient, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(
        gate_client, stock=3, unit_price=900, capture_mode="manual", hold_seconds=600
    )
    order_id = await new_order(gate_client, deal, 6021)
    session = await start_payment(gate_client, order_id, 6021)
    paid = await fake.pay(session["session_id"])
    assert paid["payment_intent"]["status"] == "requires_capture"
    assert paid["payment_intent"]["capture_method"] == "manual"
    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 900
    pi = await fake.intent(paid["payment_intent"]["id"])
    assert (pi["status"], pi["amount_received"]) == ("succeeded", 900)
    outbox = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s ORDER BY id", (order_id,)
    )
    assert [r[0] for r in outbox] == ["order.authorized", "order.paid"]
    await assert_invariants(db, rds, deal)


async def test_authorize_then_void_when_the_hold_ended(
    gate_client: Client, fake: FakeClient, db: Database, rds: aioredis.Redis, core: Gate
) -> None:
    deal = await create_deal(gate_client, stock=3, unit_price=900, capture_mode="manual")
    order_id = await new_order(gate_client, deal, 6031)
    session = await start_payment(gate_client, order_id, 6031)
    # Too close to its end to capture (margin 5 s): the hold ends, the gate voids.
    await db.execute(
        "UPDATE orders SET expires_at = NOW(6) + INTERVAL 2 SECOND WHERE id = %s", (order_id,)
    )
    paid = await fake.pay(session["session_id"])
    await wait_status(db, order_id, "AUTHORIZED")
    await expire(core, order_id)
    payment_id = paid["payment_intent"]["id"]

    async def voided() -> bool:
        return (await fake.intent(payment_id))["status"] == "canceled"

    assert await wait_until(voided)

    async def recorded_voided() -> bool:
        row = await db.fetchone("SELECT status FROM payments WHERE payment_id = %s", (payment_id,))
        return row is not None and row[0] == "voided"

    assert await wait_until(recorded_voided)
    row = await order_row(db, order_id)
    assert row["status"] == "EXPIRED" and row["paid_amount"] == 0
    assert (await fake.intent(payment_id))["amount_received"] == 0
    await assert_invariants(db, rds, deal)


@pytest.mark.parametrize(("refund_mode", "user"), [("pending", 6041), ("succeed", 6045)])
async def test_late_payment_without_stock_is_refunded_and_the_refund_notified(
    gate_client: Client,
    fake: FakeClient,
    db: Database,
    rds: aioredis.Redis,
    refund_mode: str,
    user: int,
) -> None:
    deal = await create_deal(gate_client, stock=1, unit_price=450)
    order_id = await new_order(gate_client, deal, user)
    session = await start_payment(gate_client, order_id, user)
    await fake.configure(hold=True)
    paid = await fake.pay(session["session_id"])
    [event] = await fake.events(order_id, "payment_intent.succeeded")
    r = await gate_client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
    assert r.status_code == 200, r.text
    r = await reserve(gate_client, deal, user + 1, f"stripe-late-other-{user}")
    assert r.status_code == 201  # somebody else holds the only unit now
    # pending: the refund stays pending at Stripe until its refund.updated says it
    # succeeded; succeed: it succeeds at once and charge.refunded follows the answer.
    await fake.configure(hold=False, refund_mode=refund_mode)
    assert await fake.deliver([event["id"]]) == [[200]]
    payment_id = paid["payment_intent"]["id"]

    async def asked() -> list[dict[str, Any]]:
        return [x for x in await fake.refunds() if x["payment_intent"] == payment_id]

    refunds = await wait_until(asked)
    assert [x["amount"] for x in refunds] == [450]
    assert refunds[0]["metadata"] == {"order_id": order_id}
    if refund_mode == "pending":
        assert refunds[0]["status"] == "pending"
        assert (await order_row(db, order_id))["status"] == "REFUND_PENDING"
        r = await fake.http.post(
            f"/fake/refunds/{refunds[0]['id']}/settle", json={"outcome": "succeed"}
        )
        assert r.status_code == 200
    notification = "refund.updated" if refund_mode == "pending" else "charge.refunded"

    async def notified() -> list[dict[str, Any]]:
        found = await fake.events(order_id, notification)
        return found if [e["deliveries"] for e in found] == [[200]] else []

    [delivered] = await wait_until(notified)
    # Recorded under Stripe's event id (the refund's state came from it, or from the
    # API answer just before it: either way the refund is applied once).
    kept = await db.fetchone(
        "SELECT event_type FROM payment_events WHERE provider = 'stripe' AND event_id = %s",
        (delivered["id"],),
    )
    assert kept is not None and kept[0] == "refund.succeeded"
    row = await wait_status(db, order_id, "REFUNDED")
    assert (row["paid_amount"], row["refunded_amount"]) == (450, 450)
    stored = await db.fetchone(
        "SELECT status, provider_refund_id FROM payment_refunds WHERE order_id = %s", (order_id,)
    )
    assert stored is not None and tuple(stored) == ("succeeded", refunds[0]["id"])
    recorded = await events_of(db, order_id)
    assert ("refund.succeeded", "applied") in recorded
    assert [x["amount"] for x in await fake.refunds() if x["id"] == refunds[0]["id"]] == [450]
    await assert_invariants(db, rds, deal)


def stripe_event(
    order_id: str, payment_id: str, amount: int, api_version: Any = API_VERSION
) -> bytes:
    return orjson.dumps(
        {
            "id": f"evt_test_{os.urandom(8).hex()}",
            "object": "event",
            "api_version": api_version,
            "type": "payment_intent.succeeded",
            "created": int(time.time()),
            "data": {
                "object": {
                    "id": payment_id,
                    "object": "payment_intent",
                    "amount": amount,
                    "amount_received": amount,
                    "currency": "eur",
                    "status": "succeeded",
                    "metadata": {"order_id": order_id},
                }
            },
        }
    )


async def post(client: Client, body: bytes, header: str | None) -> Resp:
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Stripe-Signature"] = header
    return await client.post(WEBHOOK, content=body, headers=headers)


async def test_forged_tampered_and_stale_notifications_are_refused_recording_nothing(
    gate_client: Client, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=300)
    order_id = await new_order(gate_client, deal, 6051)
    await start_payment(gate_client, order_id, 6051)
    before = await counts(db, order_id)
    body = stripe_event(order_id, "pi_forged0001", 300)
    now = int(time.time())
    tampered = body.replace(b'"amount_received":300', b'"amount_received":3')
    assert tampered != body
    cases = {
        "forged": (body, signature(OTHER_SECRET, now, body)),
        "tampered": (tampered, signature(STRIPE_SECRET, now, body)),
        "stale": (body, signature(STRIPE_SECRET, now - 600, body)),
        "future": (body, signature(STRIPE_SECRET, now + 600, body)),
        "missing": (body, None),
        "not v1": (body, signature(STRIPE_SECRET, now, body).replace("v1=", "v0=")),
    }
    for name, (payload, header) in cases.items():
        r = await post(gate_client, payload, header)
        assert r.status_code == 401, (name, r.status_code, r.text)
        assert r.headers["content-type"] == "application/problem+json", name
        assert r.json()["code"] == "UNAUTHORIZED", name
    # Verified but not a Stripe event: 400, nothing recorded either.
    junk = b'{"id": "evt_x", "object": "event", "type": "payment_intent.succeeded"}'
    r = await post(gate_client, junk, signature(STRIPE_SECRET, now, junk))
    assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json"
    assert await counts(db, order_id) == before
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"
    # The same body correctly signed is taken (the cases above failed on the signature).
    r = await post(gate_client, body, signature(STRIPE_SECRET, now, body))
    assert r.status_code == 200, r.text
    assert (await order_row(db, order_id))["status"] == "PAID"


async def test_a_refused_delivery_is_retried_by_stripe_and_records_nothing(
    gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=330)
    order_id = await new_order(gate_client, deal, 6057)
    session = await start_payment(gate_client, order_id, 6057)
    before = await counts(db, order_id)
    # The endpoint's secret rolled at Stripe but not at the gate: every attempt is 401.
    await fake.configure(sign_with=OTHER_SECRET)
    await fake.pay(session["session_id"])

    async def given_up() -> list[dict[str, Any]]:
        found = await fake.events(order_id, "payment_intent.succeeded")
        return found if found and len(found[0]["deliveries"]) == 6 else []

    [event] = await wait_until(given_up)
    assert event["deliveries"] == [401] * 6
    assert await counts(db, order_id) == before
    # Fixed, Stripe's next attempt (here: a redelivery from its dashboard) is taken.
    await fake.configure(sign_with=None)
    assert await fake.deliver([event["id"]]) == [[200]]
    await wait_status(db, order_id, "PAID")


async def test_a_notification_that_disagrees_with_the_order_is_quarantined(
    gate_client: Client, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=300)
    order_id = await new_order(gate_client, deal, 6055)
    body = stripe_event(order_id, "pi_wrongamount01", 299)
    r = await post(gate_client, body, signature(STRIPE_SECRET, int(time.time()), body))
    assert r.status_code == 200 and r.json()["outcome"] == "quarantined", r.text
    assert await events_of(db, order_id) == [("payment.succeeded", "quarantined")]
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"


async def test_a_duplicate_notification_is_recorded_once(
    gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=610)
    order_id = await new_order(gate_client, deal, 6061)
    session = await start_payment(gate_client, order_id, 6061)
    await fake.configure(hold=True)
    await fake.pay(session["session_id"])
    [event] = await fake.events(order_id, "payment_intent.succeeded")
    assert await fake.deliver([event["id"]], copies=3) == [[200, 200, 200]]
    await wait_status(db, order_id, "PAID")
    assert await events_of(db, order_id) == [("payment.succeeded", "applied")]
    after = await counts(db, order_id)
    assert (after["events"], after["payments"], after["outbox"]) == (1, 1, 1)


async def test_reconcile_repairs_a_dropped_notification(
    stack: StripeStack, gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=720)
    order_id = await new_order(gate_client, deal, 6071)
    session = await start_payment(gate_client, order_id, 6071)
    await fake.configure(drop=True)
    paid = await fake.pay(session["session_id"])
    payment_id = paid["payment_intent"]["id"]
    [event] = await fake.events(order_id, "payment_intent.succeeded")
    await asyncio.sleep(0.5)
    assert event["deliveries"] == [] and (await order_row(db, order_id))["status"] == (
        "PENDING_PAYMENT"
    )
    code, report = await ps.reconcile(stack.env, "--window-seconds", "600")
    assert code in (0, 1), report
    assert report["scanned"]["complete"] and report["provider"] == "stripe", report
    [finding] = [f for f in report["findings"] if f["payment_id"] == payment_id]
    assert finding["kind"] == "paid_not_applied" and finding["order_id"] == order_id, finding
    row = await order_row(db, order_id)
    assert row["status"] == "PAID" and row["payment_id"] == payment_id


async def test_api_calls_are_idempotent_and_errors_are_read(
    stack: StripeStack, gate_client: Client, fake: FakeClient, db: Database
) -> None:
    settings = load_settings(stack.env)
    adapter = load_adapter(
        stack.env,
        load_payment_settings(stack.env),
        is_dev=False,
        webhook_secrets=settings.webhook_secrets,
    )
    provider = adapter.provider
    assert isinstance(provider, StripeProvider)
    deal = await create_deal(gate_client, stock=2, unit_price=1000)
    order_id = await new_order(gate_client, deal, 6081)
    session = await start_payment(gate_client, order_id, 6081)
    payment_id = (await fake.pay(session["session_id"]))["payment_intent"]["id"]
    await wait_status(db, order_id, "PAID")
    try:
        [found] = await provider.payments_for_order(order_id)
        assert (found.payment_id, found.status, found.amount, found.currency) == (
            payment_id,
            "succeeded",
            1000,
            "EUR",
        )
        assert found.order_id == order_id
        assert await provider.get_payment("pi_does_not_exist") is None
        # A session created twice under one key (an answer lost, then retried): one
        # session at Stripe, the same answer.
        request = SessionRequest(
            order_id=order_id,
            amount=1000,
            currency="EUR",
            capture_mode="automatic",
            expires_at=int(time.time()) + 60,
            description="retried",
        )
        one = await provider.create_session(request, f"test-session-{order_id}")
        two = await provider.create_session(request, f"test-session-{order_id}")
        assert one == two and one.order_id == order_id and one.session_id.startswith("cs_")
        # The same Idempotency-Key twice: one refund at Stripe, the same answer.
        first = await provider.refund(payment_id, 100, "test-refund-6081")
        again = await provider.refund(payment_id, 100, "test-refund-6081")
        assert first == again and first.order_id == order_id and first.status == "succeeded"
        mine = [r for r in await fake.refunds() if r["payment_intent"] == payment_id]
        assert len(mine) == 1
        # The same key with other parameters, and a refund above what is left:
        # Stripe's error shape read into ProviderRejected, nothing done.
        with pytest.raises(ProviderRejected) as reused:
            await provider.refund(payment_id, 50, "test-refund-6081")
        assert reused.value.status == 400 and reused.value.code == "idempotency_error"
        with pytest.raises(ProviderRejected) as too_much:
            await provider.refund(payment_id, 5000, "test-refund-6081-b")
        assert too_much.value.code == "amount_too_large"
        assert len([r for r in await fake.refunds() if r["payment_intent"] == payment_id]) == 1
        # Capture of a PaymentIntent that is not authorized: Stripe's state error.
        with pytest.raises(ProviderRejected) as state:
            await provider.capture(payment_id, 1000, "test-capture-6081")
        assert state.value.code == "payment_intent_unexpected_state"
    finally:
        await provider.close()


async def test_a_throttled_api_is_retried_as_its_retry_after_asks(
    stack: StripeStack, fake: FakeClient
) -> None:
    """429 and 503 with Retry-After (tests/fake_stripe.py's throttle, over a real
    socket): the next attempt waits as long as asked, up to the bound; asked to wait
    longer, the call gives up at once; without the header the backoff's own waits
    apply, and the attempts stay within GATE_PAYMENT_RETRY_MAX."""
    settings = load_settings(stack.env)
    payment = load_payment_settings(stack.env)
    adapter = load_adapter(
        stack.env, payment, is_dev=False, webhook_secrets=settings.webhook_secrets
    )
    provider = adapter.provider
    assert isinstance(provider, StripeProvider)
    path = "/v1/payment_intents/pi_throttled"
    try:
        # Asked to wait one second (the bound): the retry comes no sooner, and the
        # call answers with what the API said then (no such PaymentIntent).
        await fake.configure(throttle=[[429, "1"]])
        assert await provider.get_payment("pi_throttled") is None
        first, second = await fake.arrivals(path)
        assert (first["status"], second["status"]) == (429, 404)
        assert second["at"] - first["at"] >= RETRY_AFTER_MAX_SECONDS * 0.95

        # Asked to wait longer than the bound: no second attempt now.
        await fake.configure(throttle=[[503, "30"], [503, None]])
        with pytest.raises(ProviderUnavailable, match="asked to retry after 30 s"):
            await provider.get_payment("pi_throttled")
        assert [a["status"] for a in await fake.arrivals(path)][2:] == [503]

        # No Retry-After: every attempt GATE_PAYMENT_RETRY_MAX allows, then unavailable.
        await fake.configure(throttle=[[429, None]] * payment.retry_max)
        with pytest.raises(ProviderUnavailable, match=f"after {payment.retry_max} attempt"):
            await provider.get_payment("pi_throttled")
        statuses = [a["status"] for a in await fake.arrivals(path)][3:]
        assert statuses == [429] * payment.retry_max
    finally:
        await fake.configure(throttle=[])
        await provider.close()


def test_the_signature_the_fake_sends_is_the_one_stripe_documents() -> None:
    # Stripe's documented scheme, computed by hand, verifies with the official library.
    body = b'{"id":"evt_1","object":"event"}'
    t = int(time.time())
    digest = hmac.new(STRIPE_SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    assert signature(STRIPE_SECRET, t, body) == f"t={t},v1={digest}"
    assert stripe.WebhookSignature.verify_header(
        body.decode(), f"t={t},v1={digest}", STRIPE_SECRET, 300
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"GATE_STRIPE_API_KEY": ""}, "GATE_STRIPE_API_KEY is required"),
        ({"GATE_STRIPE_WEBHOOK_SECRET": ""}, "GATE_STRIPE_WEBHOOK_SECRET is required"),
        ({"GATE_STRIPE_API_KEY": "pk_test_publishable"}, "GATE_STRIPE_API_KEY must be"),
        ({"GATE_STRIPE_WEBHOOK_SECRET": "not-a-secret"}, "GATE_STRIPE_WEBHOOK_SECRET must be"),
        ({"GATE_STRIPE_API_BASE": "http://stripe.example"}, "GATE_STRIPE_API_BASE must be https"),
    ],
)
def test_start_up_refuses_incomplete_stripe_settings(change: dict[str, str], message: str) -> None:
    # Production rules (stripe_env is a dev env, for the plain-http sandbox).
    env = {**stripe_env("http://127.0.0.1:9"), "GATE_ENV": "test", **change}
    out = serve_once(env)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
    assert STRIPE_KEY not in out.stdout + out.stderr


async def _rejected(client: Client) -> float:
    """gate_callbacks_total{provider="stripe",outcome="rejected"}, from /metrics."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("gate_callbacks_total{") and all(
            x in line for x in ('provider="stripe"', 'outcome="rejected"')
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    ("where", "bad"),
    [
        ("event", "evt_1\n"),
        ("event", "evt_" + "a" * 125),
        ("event", "evt_ü"),
        ("intent", "pi_1/../x"),
        ("intent", "pi_1 "),
        ("intent", ""),
        ("refund", "re_1\n"),
        ("refund_intent", "pi_" + "9" * 200),
    ],
)
async def test_ids_outside_stripes_alphabet_are_a_counted_400(
    gate_client: Client, db: Database, where: str, bad: str
) -> None:
    # Signed (genuine as far as the signature goes) but carrying an id Stripe never
    # issues: refused whole (fullmatch, bounded), counted as rejected, nothing recorded.
    deal = await create_deal(gate_client, stock=2, unit_price=300)
    order_id = await new_order(gate_client, deal, 6061)
    before, rejected = await counts(db, order_id), await _rejected(gate_client)
    doc = orjson.loads(stripe_event(order_id, "pi_ids0001", 300))
    if where == "event":
        doc["id"] = bad
    elif where == "intent":
        doc["data"]["object"]["id"] = bad
    else:
        doc["type"] = "refund.updated"
        doc["data"]["object"] = {
            "id": bad if where == "refund" else "re_ids0001",
            "object": "refund",
            "payment_intent": bad if where == "refund_intent" else "pi_ids0001",
            "amount": 300,
            "currency": "eur",
            "status": "succeeded",
            "metadata": {"order_id": order_id},
        }
    body = orjson.dumps(doc)
    r = await post(gate_client, body, signature(STRIPE_SECRET, int(time.time()), body))
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert await counts(db, order_id) == before
    assert await _rejected(gate_client) == rejected + 1


async def _quarantined(client: Client) -> float:
    """gate_payment_quarantined_total, from /metrics."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("gate_payment_quarantined_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_every_api_call_sends_the_pinned_stripe_version_and_the_fake_checks_it(
    stack: StripeStack, gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=410)
    order_id = await new_order(gate_client, deal, 6091)
    session = await start_payment(gate_client, order_id, 6091)
    await fake.pay(session["session_id"])
    await wait_status(db, order_id, "PAID")
    seen = (await fake._ok("GET", "/fake/versions"))["versions"]
    # The gate's calls (the session at least) all carried the one version.
    assert set(seen) == {API_VERSION} and seen[API_VERSION] >= 1, seen
    # The fake refuses what Stripe would not read as this version: without the header
    # (an account default) and with another version, a 400 naming the parameter.
    for version in (None, "2025-03-31.basil"):
        headers = {"Authorization": fake.api["Authorization"]}
        if version is not None:
            headers["Stripe-Version"] = version
        r = await fake.http.get("/v1/refunds?limit=1", headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "Stripe-Version"
    # The adapter's own client, its header taken away, is refused the same way.
    settings = load_settings(stack.env)
    adapter = load_adapter(
        stack.env,
        load_payment_settings(stack.env),
        is_dev=False,
        webhook_secrets=settings.webhook_secrets,
    )
    provider = adapter.provider
    assert isinstance(provider, StripeProvider)
    try:
        assert provider._headers["Stripe-Version"] == API_VERSION
        assert (await provider.transactions(None, 1)).items is not None
        del provider._headers["Stripe-Version"]
        with pytest.raises(ProviderRejected) as refused:
            await provider.transactions(None, 1)
        assert refused.value.status == 400
    finally:
        await provider.close()


async def test_an_event_at_another_api_version_is_quarantined_never_applied(
    gate_client: Client, fake: FakeClient, db: Database
) -> None:
    deal = await create_deal(gate_client, stock=2, unit_price=420)
    order_id = await new_order(gate_client, deal, 6093)
    session = await start_payment(gate_client, order_id, 6093)
    quarantined = await _quarantined(gate_client)
    # The endpoint was set (in Stripe's dashboard) to a version the adapter does not read.
    await fake.configure(event_api_version="2099-01-01.future")
    paid = await fake.pay(session["session_id"])
    payment_id = paid["payment_intent"]["id"]

    async def recorded() -> list[Any]:
        rows = await db.fetchall(
            "SELECT event_type, outcome, detail, payment_id FROM payment_events"
            " WHERE order_id = %s",
            (order_id,),
        )
        return [tuple(r) for r in rows]

    rows = await wait_until(recorded)
    assert rows == [
        ("quarantine.api_version_mismatch", "quarantined", "api_version_mismatch", payment_id)
    ]

    async def delivered() -> list[dict[str, Any]]:
        found = await fake.events(order_id, "payment_intent.succeeded")
        return found if found and found[0]["deliveries"] else []

    [event] = await wait_until(delivered)
    assert event["deliveries"] == [200]  # recorded: Stripe does not redeliver
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"
    assert await _quarantined(gate_client) == quarantined + 1
    [topic] = await db.fetchall(
        "SELECT topic FROM outbox WHERE aggregate_id = %s AND topic = 'payment.quarantined'",
        (order_id,),
    )
    assert topic[0] == "payment.quarantined"


async def test_events_at_a_compatible_version_apply_and_unversioned_ones_do_not(
    gate_client: Client, db: Database
) -> None:
    older = sorted(COMPATIBLE_API_VERSIONS - {API_VERSION})[0]
    deal = await create_deal(gate_client, stock=4, unit_price=300)
    cases = {older: "applied", None: "quarantined", 20240620: "quarantined", "": "quarantined"}
    for user, (version, outcome) in enumerate(cases.items(), start=6095):
        order_id = await new_order(gate_client, deal, user)
        body = stripe_event(order_id, f"pi_version{user}", 300, api_version=version)
        r = await post(gate_client, body, signature(STRIPE_SECRET, int(time.time()), body))
        assert r.status_code == 200 and r.json()["outcome"] == outcome, (version, r.text)
        status = (await order_row(db, order_id))["status"]
        assert status == ("PAID" if outcome == "applied" else "PENDING_PAYMENT"), version


def test_the_version_check_covers_the_events_acted_on_only() -> None:
    hook = StripeWebhook((Secret(STRIPE_SECRET),))
    now = int(time.time())

    def parsed(doc: dict[str, Any]) -> Any:
        body = orjson.dumps(doc)
        return hook.parse({"stripe-signature": signature(STRIPE_SECRET, now, body)}, body, now)

    base = {"id": "evt_v1", "object": "event", "created": now, "api_version": "2030-01-01.x"}
    refund = {
        "id": "re_v1",
        "object": "refund",
        "payment_intent": "pi_v1",
        "amount": 100,
        "currency": "eur",
        "status": "succeeded",
        "metadata": {"order_id": "01J00000000000000000000000"},
    }
    # Not acted on: recorded as ignored whatever the version.
    ignored = parsed({**base, "type": "customer.created", "data": {"object": {}}})
    assert ignored.type == "stripe.customer.created"
    # Acted on at an unknown version: quarantined, the ids that read as ids kept.
    for event_type, obj in (
        ("refund.updated", refund),
        ("charge.refunded", {"id": "ch_v1", "payment_intent": "pi_v1", "refunds": []}),
        ("payment_intent.succeeded", {"id": "pi_v1", "metadata": ["not", "an object"]}),
    ):
        event = parsed({**base, "type": event_type, "data": {"object": obj}})
        assert event.type == "quarantine.api_version_mismatch", event_type
        assert (event.payment_id, event.amount, event.refund_id) == ("pi_v1", None, None)
    # The same refund at the pinned version is read.
    read = parsed(
        {**base, "api_version": API_VERSION, "type": "refund.updated", "data": {"object": refund}}
    )
    assert (read.type, read.amount, read.currency) == ("refund.succeeded", 100, "EUR")


def test_docs_name_the_pinned_version_once() -> None:
    text = (ROOT / "docs" / "payments.md").read_text()
    assert text.count(f"`{API_VERSION}`") == 1
    assert API_VERSION in COMPATIBLE_API_VERSIONS
