"""Alipay and WeChat Pay end to end: a real gate (`gate serve`, GATE_PAYMENT_PROVIDER
=alipay|wechatpay) against the provider's fake process, real Redis and MariaDB.

    buyer ──reserve──> gate ──POST /v1/orders/{id}/payment──> fake (precreate / native)
    fake ──buyer pays──> notification ──> /v1/payments/{provider}/webhook ──> PAID
    late payment (hold expired, no stock) ──> REFUND_PENDING ──worker refund──> fake
        ──refund notification──> REFUNDED
    forged / tampered / stale notification ──> 401 problem+json, nothing recorded
    dropped notification ──> `gate reconcile` (per-order query) ──> PAID
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

import orjson
import pytest
import redis.asyncio as aioredis

from gate.payments.providers.alipay import (
    CST,
    TIME_FORMAT,
    AlipayProvider,
    load_alipay_settings,
    signing_string,
)
from gate.payments.providers.rsa_http import fen_to_yuan, sign_sha256_rsa
from gate.payments.providers.wechatpay import answer_message, encrypt_resource
from gate.runtime import Gate
from gate.store.db import Database
from tests import cn_support as cn
from tests import payments_support as ps
from tests.cn_support import FakeControl, KeyPair
from tests.payments_support import counts, expire, new_order, order_row, start_payment, wait_status
from tests.support import (
    Client,
    GateProcess,
    ServerProcess,
    assert_invariants,
    create_deal,
    reserve,
    serve_once,
)

core = ps.core

ALIPAY_APP_ID = cn.ALIPAY_APP_ID
MCHID = cn.WECHATPAY_MCHID
APPID = cn.WECHATPAY_APPID
APIV3_KEY = cn.WECHATPAY_APIV3_KEY
PLATFORM_SERIAL = cn.WECHATPAY_SERIAL_A  # the fake's default platform key


@dataclass
class Stack:
    provider: str
    gate: GateProcess
    fake: ServerProcess
    env: dict[str, str]
    keys: dict[str, KeyPair]
    case: cn.CnCase

    @property
    def webhook_path(self) -> str:
        return f"/v1/payments/{self.provider}/webhook"


def _stack_env(
    case: cn.CnCase, keys: dict[str, KeyPair], fake_url: str, gate_url: str
) -> dict[str, str]:
    env = ps.pay_env("http://127.0.0.1:1")
    del env["GATE_PAYMENT_PROVIDER_URL"], env["GATE_PAYMENT_API_KEY"]
    env.update(
        {
            "GATE_PAYMENT_PROVIDER": case.name,
            "GATE_PAYMENT_CALLBACK_URL": f"{gate_url}/v1/payments/{case.name}/webhook",
        }
    )
    provider = {k: v for k, v in case.env(keys, fake_url).items() if k != "GATE_ENV"}
    if case is cn.WECHATPAY:
        # The platform key under its id (the fake names it in Wechatpay-Serial): an
        # unknown serial is refused.
        del provider["GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE"]
        provider["GATE_WECHATPAY_PLATFORM_KEY_FILES"] = (
            f"{PLATFORM_SERIAL}={keys[case.provider_pair].public_file}"
        )
    env.update(provider)
    return env


@pytest.fixture(scope="module", params=list(cn.CASES))
def stack(
    request: pytest.FixtureRequest,
    prepared: None,
    cn_keys: dict[str, dict[str, KeyPair]],
    cn_fakes: dict[str, ServerProcess],
) -> Iterator[Stack]:
    case = cn.CASES[request.param]
    keys, fake = cn_keys[case.name], cn_fakes[case.name]
    port = ps.free_port()
    env = _stack_env(case, keys, fake.url, f"http://127.0.0.1:{port}")
    with GateProcess(env, workers=1, port=port) as gate:
        yield Stack(case.name, gate, fake, env, keys, case)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[Client]:
    async with Client(stack.gate.url) as c:
        yield c


@pytest.fixture
async def fake(stack: Stack) -> AsyncIterator[FakeControl]:
    c = FakeControl(stack.fake.url)
    # The fakes serve the whole session: whatever another test configured is undone.
    await c.post("/_fake/configure", dict(stack.case.reset))
    try:
        yield c
    finally:
        await c.close()


async def pay(fake: FakeControl, order_id: str, outcome: str = "succeed") -> str:
    status, doc = await fake.post("/_fake/pay", {"out_trade_no": order_id, "outcome": outcome})
    assert status == 200, doc
    return str(doc.get("trade_no") or doc.get("transaction_id"))


async def notes(fake: FakeControl, order_id: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = await fake.get(f"/_fake/notifications?out_trade_no={order_id}")
    return result


async def event_types(db: Database, order_id: str) -> list[str]:
    rows = await db.fetchall(
        "SELECT event_type FROM payment_events WHERE order_id = %s ORDER BY received_at",
        (order_id,),
    )
    return [str(r[0]) for r in rows]


async def test_reserve_session_pay_notification_paid_and_duplicate_once(
    stack: Stack, client: Client, fake: FakeControl, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=1999, stock=5)
    order_id = await new_order(client, deal, 7101)
    session = await start_payment(client, order_id, 7101)
    assert session["provider"] == stack.provider
    assert session["redirect_url"].startswith(("https://qr.alipay.com/", "weixin://"))
    payment_id = await pay(fake, order_id)

    row = await wait_status(db, order_id, "PAID")
    assert (row["paid_amount"], row["payment_id"]) == (1999, payment_id)

    async def acknowledged() -> bool:
        # The fake reads the gate's answer after the gate committed: a moment later.
        return any(n["acknowledged"] for n in await notes(fake, order_id))

    await ps.wait_until(acknowledged)
    [note] = await notes(fake, order_id)
    # Acknowledged by the provider's own rule (Alipay: body "success"; WeChat: 2xx).
    assert note["acknowledged"] and note["attempts"] == 1, note
    before = await counts(db, order_id)
    assert before["events"] == 1 and before["payments"] == 1

    # The provider sends it again (it does, until acknowledged, and sometimes after):
    # recorded once.
    _, doc = await fake.post(f"/_fake/notifications/{note['id']}/redeliver", {})
    assert doc["redelivered"]
    await ps.wait_until(
        lambda: _attempts(fake, order_id, 2)  # the redelivery was answered
    )
    assert await counts(db, order_id) == before
    await assert_invariants(db, rds, deal)


async def _attempts(fake: FakeControl, order_id: str, n: int) -> bool:
    found = await notes(fake, order_id)
    return (
        bool(found) and found[0]["attempts"] >= n and found[0]["answers"][-1][:3] in ("200", "204")
    )


async def test_failed_payment_changes_nothing(
    stack: Stack, client: Client, fake: FakeControl, db: Database
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=300, stock=5)
    order_id = await new_order(client, deal, 7111)
    await start_payment(client, order_id, 7111)
    await pay(fake, order_id, "fail")
    if stack.provider == "alipay":
        # Alipay notifies the closed trade: recorded, nothing else changes.
        await ps.wait_until(lambda: _has_event(db, order_id, "payment.failed"))
    else:
        # WeChat Pay sends no notification for a failed payment.
        await asyncio.sleep(0.5)
        assert await notes(fake, order_id) == []
    row = await order_row(db, order_id)
    assert row["status"] == "PENDING_PAYMENT" and row["paid_amount"] == 0


async def _has_event(db: Database, order_id: str, event_type: str) -> bool:
    return event_type in await event_types(db, order_id)


async def test_late_payment_without_stock_refunded_with_its_notification(
    stack: Stack,
    client: Client,
    fake: FakeControl,
    db: Database,
    rds: aioredis.Redis,
    core: Gate,
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=450, stock=1)
    order_id = await new_order(client, deal, 7121)
    await start_payment(client, order_id, 7121)
    await expire(core, order_id)
    r = await reserve(client, deal, 7122, f"cn-late-other-{stack.provider}")
    assert r.status_code == 201  # somebody else holds the only unit now
    payment_id = await pay(fake, order_id)

    row = await wait_status(db, order_id, "REFUNDED", timeout_seconds=20)
    assert row["paid_amount"] == 450 and row["refunded_amount"] == 450
    stored = await db.fetchone(
        "SELECT status, provider_refund_id, reason FROM payment_refunds WHERE order_id = %s",
        (order_id,),
    )
    assert stored is not None and stored[0] == "succeeded" and stored[2] == "late_no_stock"
    # The refund carried the gate's key as out_request_no / out_refund_no.
    assert stored[1] == f"refund-{stack.provider}-{payment_id}-0"
    # And its notification came and was recorded, not quarantined.
    await ps.wait_until(lambda: _has_event(db, order_id, "refund.succeeded"))
    quarantined = await db.fetchall(
        "SELECT event_id FROM payment_events WHERE order_id = %s AND outcome = 'quarantined'",
        (order_id,),
    )
    assert quarantined == []
    await assert_invariants(db, rds, deal)


async def test_late_payment_with_stock_is_paid(
    stack: Stack, client: Client, fake: FakeControl, db: Database, rds: aioredis.Redis, core: Gate
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=250, stock=3)
    order_id = await new_order(client, deal, 7131)
    await start_payment(client, order_id, 7131)
    await expire(core, order_id)
    await pay(fake, order_id)
    row = await wait_status(db, order_id, "PAID")
    assert row["paid_amount"] == 250 and row["refunded_amount"] == 0
    await assert_invariants(db, rds, deal)


def _forged(
    stack: Stack, order_id: str, change: str, fen: int = 500
) -> tuple[bytes, dict[str, str]]:
    now = time.time()
    when = now - 301 if change == "stale" else now
    signer = stack.keys["other" if change == "forged" else stack.case.provider_pair].private
    if stack.provider == "alipay":
        stamp = datetime.fromtimestamp(when, CST).strftime(TIME_FORMAT)
        params = {
            "notify_time": stamp,
            "notify_type": "trade_status_sync",
            "notify_id": "forged-1",
            "app_id": "2021999999999999" if change == "other_app" else ALIPAY_APP_ID,
            "charset": "utf-8",
            "version": "1.0",
            "sign_type": "RSA2",
            "trade_no": f"20261201220019{secrets.randbelow(10**14):014d}",
            "out_trade_no": order_id,
            "trade_status": "TRADE_SUCCESS",
            "total_amount": fen_to_yuan(fen),
            "gmt_payment": stamp,
        }
        params["sign"] = sign_sha256_rsa(signer, signing_string(params, notification=True))
        body = urlencode(params).encode()
        if change == "tampered":
            body = body.replace(b"total_amount=5.00", b"total_amount=0.01")
            assert fen == 500
        return body, {"Content-Type": "application/x-www-form-urlencoded"}
    plain = orjson.dumps(
        {
            "mchid": "1900000002" if change == "other_app" else MCHID,
            "appid": APPID,
            "out_trade_no": order_id,
            "transaction_id": f"42000000002099{secrets.randbelow(10**14):014d}",
            "trade_state": "SUCCESS",
            "amount": {"total": fen, "currency": "CNY"},
        }
    )
    body = orjson.dumps(
        {
            "id": "forged-1",
            "event_type": "TRANSACTION.SUCCESS",
            "resource_type": "encrypt-resource",
            "resource": {
                "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": encrypt_resource(APIV3_KEY, plain, "abcdefghijkl", "transaction"),
                "associated_data": "transaction",
                "nonce": "abcdefghijkl",
                "original_type": "transaction",
            },
        }
    )
    ts, nonce = str(int(when)), "N0NCE"
    headers = {
        "Content-Type": "application/json",
        "Wechatpay-Timestamp": ts,
        "Wechatpay-Nonce": nonce,
        "Wechatpay-Signature": sign_sha256_rsa(signer, answer_message(ts, nonce, body)),
        "Wechatpay-Serial": PLATFORM_SERIAL,
    }
    if change == "tampered":
        body = body.replace(b"forged-1", b"forged-2")
    return body, headers


@pytest.mark.parametrize("change", ["forged", "tampered", "stale"])
async def test_forged_tampered_stale_notifications_refused(
    stack: Stack, client: Client, db: Database, change: str
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5)
    order_id = await new_order(client, deal, 7141)
    before = await counts(db, order_id)
    body, headers = _forged(stack, order_id, change)
    r = await client.post(stack.webhook_path, content=body, headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert await counts(db, order_id) == before
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"
    # The genuine one (same bytes, right key, fresh) is taken: the refusal was the
    # signature's, not the shape's.
    if change == "forged":
        body, headers = _forged(stack, order_id, "genuine")
        r = await client.post(stack.webhook_path, content=body, headers=headers)
        assert r.status_code in (200, 204), r.text
        assert (await order_row(db, order_id))["status"] == "PAID"


async def test_reconcile_repairs_a_dropped_notification(
    stack: Stack, client: Client, fake: FakeControl, db: Database, rds: aioredis.Redis
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=880, stock=5)
    order_id = await new_order(client, deal, 7151)
    await start_payment(client, order_id, 7151)
    await fake.post("/_fake/configure", {"drop_notifications": 1})
    payment_id = await pay(fake, order_id)
    [note] = await notes(fake, order_id)
    assert note["dropped"] and note["attempts"] == 0
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"

    report = await _reconcile(stack)
    assert report["provider"] == stack.provider and report["scanned"]["transactions"] >= 1, report
    kinds = {f["kind"] for f in report["findings"] if f["payment_id"] == payment_id}
    assert kinds, report
    row = await wait_status(db, order_id, "PAID")
    assert (row["paid_amount"], row["payment_id"]) == (880, payment_id)
    await assert_invariants(db, rds, deal)


async def test_manual_capture_deal_has_no_session(
    stack: Stack, client: Client, db: Database
) -> None:
    # Neither adapter offers authorize-then-capture: the session is refused (503,
    # problem+json) and the order keeps its hold until it expires or is cancelled.
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5, capture_mode="manual")
    order_id = await new_order(client, deal, 7161)
    r = await client.post(f"/v1/orders/{order_id}/payment", headers=ps.buyer(7161))
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"


def test_start_up_refuses_incomplete_settings_naming_the_variable(stack: Stack) -> None:
    required = [
        k
        for k in stack.env
        if k.startswith(("GATE_ALIPAY_", "GATE_WECHATPAY_")) and not k.endswith(("_URL", "_BASE"))
    ]
    assert len(required) == (3 if stack.provider == "alipay" else 6)
    if stack.provider == "wechatpay":
        # WeChat has no default notify_url: the callback URL is required too.
        required.append("GATE_PAYMENT_CALLBACK_URL")
    for name in required:
        env = {k: v for k, v in stack.env.items() if k != name}
        # Port 1: were the configuration accepted, binding would fail loudly instead.
        out = serve_once(env)
        assert out.returncode == 2, out.stderr
        assert name in out.stderr and "Traceback" not in out.stderr


async def test_genuine_notification_with_the_wrong_amount_is_quarantined(
    stack: Stack, client: Client, db: Database
) -> None:
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5)
    order_id = await new_order(client, deal, 7171)
    body, headers = _forged(stack, order_id, "genuine", fen=499)
    r = await client.post(stack.webhook_path, content=body, headers=headers)
    assert r.status_code in (200, 204), r.text
    row = await db.fetchone("SELECT outcome FROM payment_events WHERE order_id = %s", (order_id,))
    assert row is not None and row[0] == "quarantined"
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe\x00",
        b"a=1&a=2",
        b"%zz",
        b"&".join([b"k%d=v" % i for i in range(500)]),
        b'{"id":"x","resource":{}}',
        b"[]",
    ],
)
async def test_bad_input_is_refused_with_a_4xx_and_records_nothing(
    stack: Stack, client: Client, db: Database, body: bytes
) -> None:
    before = await db.fetchone("SELECT COUNT(*) FROM payment_events")
    for headers in (
        {},
        {"Wechatpay-Timestamp": "\u00b2", "Wechatpay-Nonce": "n", "Wechatpay-Signature": "x"},
        {
            "Wechatpay-Timestamp": str(int(time.time())),
            "Wechatpay-Nonce": "n" * 200,
            "Wechatpay-Signature": "!!!",
        },
    ):
        r = await client.post(
            stack.webhook_path,
            content=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
        )
        assert r.status_code in (400, 401), (r.status_code, r.text)
        assert r.headers["content-type"] == "application/problem+json"
    assert await db.fetchone("SELECT COUNT(*) FROM payment_events") == before


async def test_refund_settles_without_its_notification(
    stack: Stack,
    client: Client,
    fake: FakeControl,
    db: Database,
    rds: aioredis.Redis,
    core: Gate,
) -> None:
    # Alipay settles the refund in its answer; WeChat answers PROCESSING and the
    # notification would settle it. With that notification lost, the worker asks
    # again with the same out_refund_no (the refund is 'submitted') and WeChat's
    # answer is SUCCESS: one refund at the provider, the order REFUNDED.
    deal = await create_deal(client, currency="CNY", unit_price=650, stock=1)
    order_id = await new_order(client, deal, 7181)
    await start_payment(client, order_id, 7181)
    await expire(core, order_id)
    r = await reserve(client, deal, 7182, f"cn-refund-drop-{stack.provider}")
    assert r.status_code == 201
    await fake.post("/_fake/configure", {"drop_refund_notifications": 1})
    payment_id = await pay(fake, order_id)

    row = await wait_status(db, order_id, "REFUNDED", timeout_seconds=20)
    assert row["paid_amount"] == 650 and row["refunded_amount"] == 650
    found = await notes(fake, order_id)
    assert [n["dropped"] for n in found] == [False, True], found
    # Settled from the provider's answer (a synthetic `api:` event), not a notification.
    assert [e.split(":")[0] for e in await _refund_event_ids(db, order_id)] == ["api"]
    refunds = await db.fetchall(
        "SELECT provider_refund_id, status FROM payment_refunds WHERE order_id = %s", (order_id,)
    )
    assert [tuple(r) for r in refunds] == [(f"refund-{stack.provider}-{payment_id}-0", "succeeded")]
    await assert_invariants(db, rds, deal)


async def _refund_event_ids(db: Database, order_id: str) -> list[str]:
    rows = await db.fetchall(
        "SELECT event_id FROM payment_events"
        " WHERE order_id = %s AND event_type = 'refund.succeeded'",
        (order_id,),
    )
    return [str(r[0]) for r in rows]


async def test_another_merchants_genuine_notification_is_quarantined(
    stack: Stack, client: Client, db: Database
) -> None:
    # Genuine (the provider signed it) but for another app / merchant: it names no
    # order of this gate, whatever its out_trade_no says. Recorded, quarantined, 2xx.
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5)
    order_id = await new_order(client, deal, 7191)
    before = await counts(db, order_id)
    body, headers = _forged(stack, order_id, "other_app")
    r = await client.post(stack.webhook_path, content=body, headers=headers)
    assert r.status_code in (200, 204), r.text
    row = await db.fetchone(
        "SELECT order_id, outcome, payload FROM payment_events"
        " WHERE provider = %s AND payload = %s",
        (stack.provider, body.decode()),
    )
    assert row is not None and row[0] is None and row[1] == "quarantined", row
    assert await counts(db, order_id) == before
    assert (await order_row(db, order_id))["status"] == "PENDING_PAYMENT"


async def test_reconcile_flags_paid_without_a_payment_at_the_provider(
    stack: Stack, client: Client, db: Database
) -> None:
    # A notification that verifies (signed with the provider's key) for a payment the
    # provider does not have: the gate applied it; reconciliation asks the provider
    # for that payment (trade query / transaction by id), hears "unknown" and flags it.
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5)
    order_id = await new_order(client, deal, 7201)
    body, headers = _forged(stack, order_id, "genuine")
    r = await client.post(stack.webhook_path, content=body, headers=headers)
    assert r.status_code in (200, 204), r.text
    row = await wait_status(db, order_id, "PAID")

    report = await _reconcile(stack)
    flagged = [
        f
        for f in report["findings"]
        if f["kind"] == "paid_without_payment" and f["order_id"] == order_id
    ]
    assert flagged and flagged[0]["outcome"] == "flagged", report
    assert flagged[0]["payment_id"] == row["payment_id"]
    assert flagged[0]["detail"] == "unknown at the provider"
    assert (await order_row(db, order_id))["status"] == "PAID"  # never un-paid


async def _reconcile(stack: Stack) -> dict[str, Any]:
    _, report = await ps.reconcile({**stack.env, "GATE_RECONCILE_GRACE_SECONDS": "0"})
    assert report["provider"] == stack.provider, report
    return report


async def _rejected(client: Client, provider: str) -> float:
    """gate_callbacks_total{outcome="rejected"} of `provider`, from /metrics."""
    text = (await client.get("/metrics")).text
    labels = (f'provider="{provider}"', 'outcome="rejected"')
    for line in text.splitlines():
        if line.startswith("gate_callbacks_total{") and all(x in line for x in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_serial_naming_no_configured_key_is_a_counted_401(
    stack: Stack, client: Client, db: Database
) -> None:
    if stack.provider != "wechatpay":
        pytest.skip("Wechatpay-Serial is WeChat Pay's")
    deal = await create_deal(client, currency="CNY", unit_price=500, stock=5)
    order_id = await new_order(client, deal, 7191)
    before, rejected = await counts(db, order_id), await _rejected(client, "wechatpay")
    body, headers = _forged(stack, order_id, "genuine")
    # Signed by the configured key, but named as a key the gate does not have (a
    # rotation it was not told of), a serial one digit pair longer, bytes outside ASCII.
    serials = ["PUB_KEY_ID_0999", PLATFORM_SERIAL + "00", "5157\u00e9"]  # é: sent as UTF-8
    for serial in serials:
        r = await client.post(
            stack.webhook_path, content=body, headers={**headers, "Wechatpay-Serial": serial}
        )
        assert r.status_code == 401, r.text
        assert r.headers["content-type"] == "application/problem+json"
    assert await counts(db, order_id) == before
    assert await _rejected(client, "wechatpay") == rejected + len(serials)
    r = await client.post(stack.webhook_path, content=body, headers=headers)
    assert r.status_code in (200, 204), r.text
    assert (await order_row(db, order_id))["status"] == "PAID"


async def _refund_amounts(db: Database, order_id: str) -> list[int]:
    rows = await db.fetchall(
        "SELECT amount FROM payment_events WHERE order_id = %s AND event_type = 'refund.succeeded'"
        " ORDER BY received_at, event_id",
        (order_id,),
    )
    return [int(r[0]) for r in rows]


async def _paid_order(
    client: Client, fake: FakeControl, db: Database, user: int
) -> tuple[str, str]:
    """An order of 100 CNY paid at the provider (its id there) and PAID at the gate."""
    deal = await create_deal(client, currency="CNY", unit_price=10_000, stock=5)
    order_id = await new_order(client, deal, user)
    await start_payment(client, order_id, user)
    payment_id = await pay(fake, order_id)
    await wait_status(db, order_id, "PAID")
    return order_id, payment_id


def _alipay(stack: Stack) -> AlipayProvider:
    """The gate's Alipay adapter as an operator's console would act: refunds made at
    Alipay, outside the gate's own refund worker."""
    return AlipayProvider(cn.cn_pay_settings("alipay"), load_alipay_settings(stack.env))


async def test_two_partial_alipay_refunds_record_two_right_amounts(
    stack: Stack, client: Client, fake: FakeControl, db: Database
) -> None:
    # Refunds of 30 and 20 on a 100 trade, made at Alipay (its console, say): the
    # notifications say refund_fee 30.00 then 50.00 (the refunded total); the gate
    # records 30 and 20, and a redelivery records nothing new.
    if stack.provider != "alipay":
        pytest.skip("refund_fee is Alipay's")
    order_id, trade_no = await _paid_order(client, fake, db, 7192)
    alipay = _alipay(stack)
    try:
        await alipay.refund(trade_no, 3000, "console-refund-1")
        assert await ps.wait_until(lambda: _has_event(db, order_id, "refund.succeeded"))
        await alipay.refund(trade_no, 2000, "console-refund-2")

        async def two() -> bool:
            return len(await _refund_amounts(db, order_id)) == 2

        assert await ps.wait_until(two)
    finally:
        await alipay.close()
    assert await _refund_amounts(db, order_id) == [3000, 2000]
    refund_notes = [n for n in await notes(fake, order_id) if n["kind"] == "refund"]
    assert len(refund_notes) == 2
    rows = await db.fetchall(
        "SELECT refund_id, payload FROM payment_events WHERE order_id = %s"
        " AND event_type = 'refund.succeeded' ORDER BY received_at, event_id",
        (order_id,),
    )
    assert [r[0] for r in rows] == ["console-refund-1", "console-refund-2"]
    assert ["refund_fee=30.00" in r[1] for r in rows] == [True, False]
    assert "refund_fee=50.00" in rows[1][1]
    before = await counts(db, order_id)
    _, doc = await fake.post(f"/_fake/notifications/{refund_notes[0]['id']}/redeliver", {})
    assert doc["redelivered"]

    async def answered() -> bool:
        found = [n for n in await notes(fake, order_id) if n["id"] == refund_notes[0]["id"]]
        return found[0]["attempts"] >= 2

    assert await ps.wait_until(answered)
    assert await counts(db, order_id) == before
    assert await _refund_amounts(db, order_id) == [3000, 2000]


async def test_an_alipay_refund_notification_waits_for_alipays_answer(
    stack: Stack, client: Client, fake: FakeControl, db: Database
) -> None:
    # The refund's own amount comes from Alipay's refund query: while Alipay does not
    # answer, the notification is a 503 and nothing is recorded; the redelivery is.
    if stack.provider != "alipay":
        pytest.skip("refund_fee is Alipay's")
    order_id, trade_no = await _paid_order(client, fake, db, 7193)
    await fake.post("/_fake/configure", {"drop_refund_notifications": 1})
    alipay = _alipay(stack)
    try:
        await alipay.refund(trade_no, 4000, "console-refund-3")
    finally:
        await alipay.close()
    [note] = [n for n in await notes(fake, order_id) if n["kind"] == "refund"]
    assert note["dropped"]
    try:
        await fake.post("/_fake/configure", {"unavailable_calls": 100})
        await fake.post(f"/_fake/notifications/{note['id']}/redeliver", {})

        async def answered(times: int) -> list[str]:
            found = [n for n in await notes(fake, order_id) if n["id"] == note["id"]]
            answers = list(found[0]["answers"])
            return answers if len(answers) >= times else []

        answers = await ps.wait_until(lambda: answered(1))
        assert answers and answers[-1].startswith("503"), answers
        assert await _refund_amounts(db, order_id) == []
    finally:
        await fake.post("/_fake/configure", {"unavailable_calls": 0})
    await fake.post(f"/_fake/notifications/{note['id']}/redeliver", {})
    answers = await ps.wait_until(lambda: answered(2))
    assert answers[-1].startswith("200"), answers
    assert await _refund_amounts(db, order_id) == [4000]
