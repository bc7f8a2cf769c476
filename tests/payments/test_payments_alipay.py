"""The Alipay adapter: RSA2 signing as documented, exact yuan amounts, start-up
settings, notification verification (forged, tampered, stale, another app's, one
Alipay really signed), ids checked, and what only Alipay does against its fake
(refund_fee is the trade's refunded total). The contract Alipay and WeChat Pay both
keep against their fakes is tests/payments/test_payments_cn_contract.py."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import pytest
from ulid import ULID

from gate.base.settings import SettingsError
from gate.payments.provider import EventInvalid
from gate.payments.providers.alipay import (
    CST,
    TIME_FORMAT,
    AlipaySettings,
    AlipayWebhook,
    load_alipay_settings,
    parse_notification,
    signing_string,
)
from gate.payments.providers.rsa_http import fen_to_yuan, sign_sha256_rsa, yuan_to_fen
from gate.payments.signing import WebhookRejected
from tests.cn_support import (
    ALIPAY_APP_ID,
    CnStack,
    KeyPair,
    alipay_env,
    eventually,
    session_request,
)

APP_ID = ALIPAY_APP_ID
env_for = alipay_env


@pytest.fixture(scope="module")
def keys(cn_keys: dict[str, dict[str, KeyPair]]) -> dict[str, KeyPair]:
    return cn_keys["alipay"]


# -- signing, amounts, settings -------------------------------------------------------


BIZ = '{"button":[{"actionParam":"ZFB_HFCZ","actionType":"out","name":"话费充值"}]}'


def test_signing_string_is_alipays_documented_shape() -> None:
    # The request example of Alipay's "自行实现签名" page (opendocs.alipay.com/common/
    # 02kf5q): sorted, raw values, sign left out, sign_type kept on requests. The
    # page publishes no key pair with a signature, so no signature bytes to compare.
    params = {
        "method": "alipay.mobile.public.menu.add",
        "charset": "GBK",
        "sign_type": "RSA2",
        "timestamp": "2014-07-24 03:07:50",
        "biz_content": BIZ,
        "app_id": "2014072300007148",
        "version": "1.0",
        "sign": "ignored",
        "empty": "",
    }
    assert (
        signing_string(params)
        == (
            "app_id=2014072300007148&biz_content="
            '{"button":[{"actionParam":"ZFB_HFCZ","actionType":"out","name":"话费充值"}]}'
            "&charset=GBK&method=alipay.mobile.public.menu.add&sign_type=RSA2"
            "&timestamp=2014-07-24 03:07:50&version=1.0"
        ).encode()
    )
    # Asynchronous notifications: sign and sign_type both left out.
    assert b"sign_type" not in signing_string(params, notification=True)


@pytest.mark.parametrize(
    ("text", "fen"),
    [("88.88", 8888), ("0.01", 1), ("1", 100), ("1.5", 150), ("100000000.00", 10_000_000_000)],
)
def test_yuan_to_fen_exact(text: str, fen: int) -> None:
    assert yuan_to_fen(text) == fen
    assert yuan_to_fen(fen_to_yuan(fen)) == fen


@pytest.mark.parametrize("text", ["0.001", "-1.00", "1e3", "", "1,00", "NaN", "0.1.1", " 1"])
def test_yuan_to_fen_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        yuan_to_fen(text)


@pytest.mark.parametrize(
    "missing",
    ["GATE_ALIPAY_APP_ID", "GATE_ALIPAY_PRIVATE_KEY_FILE", "GATE_ALIPAY_PUBLIC_KEY_FILE"],
)
def test_settings_name_the_missing_variable(keys: dict[str, KeyPair], missing: str) -> None:
    env = env_for(keys, "http://127.0.0.1:1")
    del env[missing]
    with pytest.raises(SettingsError, match=missing):
        load_alipay_settings(env)


def test_settings_refuse_bad_files_and_plain_http(keys: dict[str, KeyPair], tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    with pytest.raises(SettingsError, match="GATE_ALIPAY_PRIVATE_KEY_FILE"):
        load_alipay_settings(env_for(keys, "http://x", GATE_ALIPAY_PRIVATE_KEY_FILE=str(bad)))
    with pytest.raises(SettingsError, match="GATE_ALIPAY_PUBLIC_KEY_FILE"):
        load_alipay_settings(env_for(keys, "http://x", GATE_ALIPAY_PUBLIC_KEY_FILE="/nonexistent"))
    env = env_for(keys, "http://alipay.example")
    env["GATE_ENV"] = "production"
    with pytest.raises(SettingsError, match="GATE_ALIPAY_GATEWAY_URL"):
        load_alipay_settings(env)
    # The settings never show the keys.
    settings = load_alipay_settings(env_for(keys, "http://127.0.0.1:1"))
    assert "PRIVATE" not in repr(settings)


# -- notifications, verified offline ---------------------------------------------------


def notification(
    key: KeyPair, now: float, *, app_id: str = APP_ID, **over: str
) -> tuple[dict[str, str], bytes]:
    params = {
        "notify_time": datetime.fromtimestamp(now, CST).strftime(TIME_FORMAT),
        "notify_type": "trade_status_sync",
        "notify_id": "ac05099524730693a8b330c5ecf72da9786",
        "app_id": app_id,
        "charset": "utf-8",
        "version": "1.0",
        "sign_type": "RSA2",
        "trade_no": "2013112011001004330000121536",
        "out_trade_no": str(ULID()),
        "trade_status": "TRADE_SUCCESS",
        "total_amount": "88.88",
        "gmt_payment": datetime.fromtimestamp(now, CST).strftime(TIME_FORMAT),
        **over,
    }
    params["sign"] = sign_sha256_rsa(key.private, signing_string(params, notification=True))
    return params, urlencode(params).encode()


def settings_of(keys: dict[str, KeyPair]) -> AlipaySettings:
    return load_alipay_settings(env_for(keys, "http://127.0.0.1:1"))


def test_genuine_notification_reads_as_a_payment(keys: dict[str, KeyPair]) -> None:
    now = time.time()
    params, body = notification(keys["alipay"], now)
    event = parse_notification(settings_of(keys), body, now)
    assert event.type == "payment.succeeded"
    assert event.order_id == params["out_trade_no"]
    assert event.payment_id == params["trade_no"]
    assert (event.amount, event.currency) == (8888, "CNY")
    assert event.payload == body
    # A retry of the same notification (new notify_time, new signature) is the same
    # event: recorded once.
    _, body2 = notification(
        keys["alipay"], now + 60, out_trade_no=params["out_trade_no"], notify_id="x2"
    )
    assert parse_notification(settings_of(keys), body2, now + 60).event_id == event.event_id


def test_another_apps_genuine_notification_names_no_order(keys: dict[str, KeyPair]) -> None:
    # Signed by Alipay, for another app: recorded and quarantined (no order id), not
    # refused, as the adapter contract says.
    now = time.time()
    params, body = notification(keys["alipay"], now, app_id="2021999999999999")
    event = parse_notification(settings_of(keys), body, now)
    assert event.order_id is None and event.payment_id == params["trade_no"]
    assert event.type == "payment.succeeded" and event.payload == body


def test_refund_and_closed_notifications(keys: dict[str, KeyPair]) -> None:
    now = time.time()
    _, body = notification(
        keys["alipay"],
        now,
        trade_status="TRADE_CLOSED",
        out_biz_no="refund-alipay-x-0",
        refund_fee="88.88",
        gmt_refund=datetime.fromtimestamp(now, CST).strftime(TIME_FORMAT),
    )
    event = parse_notification(settings_of(keys), body, now)
    assert (event.type, event.refund_id, event.amount) == (
        "refund.succeeded",
        "refund-alipay-x-0",
        8888,
    )
    _, body = notification(keys["alipay"], now, trade_status="TRADE_CLOSED")
    assert parse_notification(settings_of(keys), body, now).type == "payment.failed"


@pytest.mark.parametrize(
    "change", ["forged", "tampered", "stale", "ahead", "no_sign", "repeated", "rsa1"]
)
def test_notification_refused(keys: dict[str, KeyPair], change: str) -> None:
    now = time.time()
    key = keys["other"] if change == "forged" else keys["alipay"]
    when = now - 301 if change == "stale" else now + 301 if change == "ahead" else now
    params, body = notification(key, when)
    if change == "tampered":
        body = body.replace(b"total_amount=88.88", b"total_amount=0.01")
    elif change == "no_sign":
        body = urlencode({k: v for k, v in params.items() if k != "sign"}).encode()
    elif change == "repeated":
        body += b"&total_amount=0.01"
    elif change == "rsa1":
        body = body.replace(b"sign_type=RSA2", b"sign_type=RSA")
    with pytest.raises(WebhookRejected):
        parse_notification(settings_of(keys), body, now)


# A notification Alipay really sent and signed (trade_status_sync, 2019-08-15), with
# Alipay's notification public key, as published in Alipay's own SDK tests
# (github.com/alipay/alipay-sdk-nodejs-all, test/alipay.test.ts, "checkNotifySign":
# "从实测中获取", captured from a real call). The key is public; nothing here is secret.
ALIPAY_NOTIFY_PUBLIC_KEY = (
    "MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAqObrdC7hrgAVM98tK0nv3hSQRGGKT4lBsQjHiGj"
    "eYZjOPIPHR5knm2jnnz/YGIXIofVHkA/tAlBAd5DrY7YpvI4tP5EONLtZKC2ghBMx7McI2wRD0xiqzxOQr1"
    "FuhZGJ8/AUokBzJrzY+aGX2xcOrxFYRlFilvVLTXg4LWjR1tdPkO6+i7wQZAIVMClPkwVRZEbaERRHlKqTz"
    "v2gGv5rDU8gRoe1LeaN+6BlbTqHWkQcNCUNrA8C6l17XAXGKDsm/9TFWwO8EPHHHCaQdjtV5/FdcWIt+L8SR"
    "1ss7EXTjYDFtxcKVv9rEoY1lX8T4mX+GbXfZHraG5NCF1+XioL5JwIDAQAB"
)
ALIPAY_NOTIFICATION = {
    "gmt_create": "2019-08-15 15:56:22",
    "charset": "utf-8",
    "seller_email": "z97-yuquerevenue@service.aliyun.com",
    "subject": "语雀空间 500人规模",
    "sign": (
        "QfTb8tqE1BMhS5qAnXtvsF3/jBkEvu9q9en0pdbBUDDjvKycZhQb7h8GDs4FKfi049PynaNuatxSgLb/nLWZ"
        "pXyyh0LEWdK2S6Ri7nPwrVgOs08zugLO20vOQz44y3ti2Ncm8/wZts1Fr2gZ7pShnVX3d1B50hbsXnObT1r/"
        "U8ONNQjWXd0HIul4TG+Q3fm3svmSvFEy0WnzuhcyHPX5Gm4ELNctL6Qd5YniGJFNcc7kopHYtI/XD9YCKCH6"
        "Ct02rzUs9i11C9CsadtZn+WhxF26Dqt9sGEFajkJ8cxUTLi8+VCpLHsgPE8P0y095uQcDdK0YjCh4x7wVSov"
        "+lrmOQ=="
    ),
    "buyer_id": "2088102534368455",
    "invoice_amount": "0.10",
    "notify_id": "2019081500222155624068450559358070",
    "fund_bill_list": '[{"amount":"0.10","fundChannel":"ALIPAYACCOUNT"}]',
    "notify_type": "trade_status_sync",
    "trade_status": "TRADE_SUCCESS",
    "receipt_amount": "0.10",
    "buyer_pay_amount": "0.10",
    "sign_type": "RSA2",
    "app_id": "2019073166072302",
    "seller_id": "2088531891668739",
    "gmt_payment": "2019-08-15 15:56:24",
    "notify_time": "2019-08-15 15:56:25",
    "version": "1.0",
    "out_trade_no": "20190815155618536-564-57",
    "total_amount": "0.10",
    "trade_no": "2019081522001468450512505578",
    "auth_app_id": "2019073166072302",
    "buyer_logon_id": "xud***@126.com",
    "point_amount": "0.00",
}


def test_a_notification_alipay_really_signed_verifies(
    keys: dict[str, KeyPair], tmp_path: Path
) -> None:
    public = tmp_path / "alipay-notify-public.txt"
    public.write_text(ALIPAY_NOTIFY_PUBLIC_KEY)  # the console's bare base64 form
    settings = load_alipay_settings(
        env_for(
            keys,
            "http://127.0.0.1:1",
            GATE_ALIPAY_APP_ID="2019073166072302",
            GATE_ALIPAY_PUBLIC_KEY_FILE=str(public),
        )
    )
    body = urlencode(ALIPAY_NOTIFICATION).encode()
    sent = datetime.strptime("2019-08-15 15:56:25", TIME_FORMAT).replace(tzinfo=CST).timestamp()
    event = parse_notification(settings, body, sent + 10)
    assert (event.type, event.amount, event.currency) == ("payment.succeeded", 10, "CNY")
    assert event.payment_id == "2019081522001468450512505578"
    assert event.order_id is None  # not an order id this gate issues: quarantined
    # The signed string leaves sign_type out: signed with it, the same bytes fail.
    assert b"sign_type" not in signing_string(ALIPAY_NOTIFICATION, notification=True)
    for change in ({"total_amount": "1000.10"}, {"app_id": APP_ID}):
        with pytest.raises(WebhookRejected):
            parse_notification(
                settings, urlencode({**ALIPAY_NOTIFICATION, **change}).encode(), sent
            )
    with pytest.raises(WebhookRejected):  # stale: 301 s after it was sent
        parse_notification(settings, body, sent + 301)


# -- ids checked; against the fake: refund_fee cumulative -----------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("trade_no", "2013112011001004330000121536\n"),
        ("trade_no", "20131120110010043300001215x6"),
        ("trade_no", "1" * 65),
        ("trade_no", ""),
        ("trade_status", "TRADE SUCCESS"),
        ("out_biz_no", "refund alipay"),
        ("out_biz_no", "r" * 65),
        ("out_biz_no", "refund-alipay-x-0\n"),
        ("out_biz_no", "refund-é"),
    ],
)
def test_ids_outside_alipays_alphabet_are_refused(
    keys: dict[str, KeyPair], field: str, value: str
) -> None:
    now = time.time()
    over = {field: value}
    if field == "out_biz_no":
        over |= {"refund_fee": "1.00", "gmt_refund": over.get("gmt_refund", "2026-12-01 17:00:00")}
    _, body = notification(keys["alipay"], now, **over)
    with pytest.raises(EventInvalid):
        parse_notification(settings_of(keys), body, now)


def test_an_order_id_that_only_starts_like_one_names_no_order(keys: dict[str, KeyPair]) -> None:
    now = time.time()
    _, body = notification(keys["alipay"], now, out_trade_no=str(ULID()) + "X")
    assert parse_notification(settings_of(keys), body, now).order_id is None


@pytest.mark.parametrize("cn", ["alipay"], indirect=True)
async def test_two_partial_refunds_record_their_own_amounts(
    cn: CnStack,
) -> None:
    # Alipay's refund_fee is the trade's refunded total: refunds of 30 and 20 on a
    # 100 trade are notified with 30.00 then 50.00; each event is that refund's own
    # amount (asked of the refund query), and a redelivery is the same event.
    provider, sink, control = cn.provider, cn.sink, cn.control
    request = session_request(sink, amount=10_000)
    await provider.create_session(request, "k")
    _, trade = await control.post("/_fake/pay", {"out_trade_no": request.order_id})
    await eventually(lambda: sink.of_type("payment.succeeded", request.order_id))
    trade_no = trade["trade_no"]
    await provider.refund(trade_no, 3000, f"refund-alipay-{trade_no}-a")
    await eventually(lambda: len(sink.of_type("refund.succeeded", request.order_id)) == 1)
    await provider.refund(trade_no, 2000, f"refund-alipay-{trade_no}-b")
    events = await eventually(
        lambda: (
            (found := sink.of_type("refund.succeeded", request.order_id))
            and len(found) == 2
            and found
        )
    )
    fees = [parse_qs(e.payload.decode())["refund_fee"] for e in events]
    assert fees == [["30.00"], ["50.00"]]
    assert [(e.refund_id, e.amount) for e in events] == [
        (f"refund-alipay-{trade_no}-a", 3000),
        (f"refund-alipay-{trade_no}-b", 2000),
    ]
    notes = await control.get(f"/_fake/notifications?out_trade_no={request.order_id}")
    refund_notes = [n for n in notes if n["kind"] == "refund"]
    received = sink.received
    await control.post(f"/_fake/notifications/{refund_notes[0]['id']}/redeliver", {})
    await eventually(lambda: sink.received == received + 1)
    assert len(sink.of_type("refund.succeeded", request.order_id)) == 2


@pytest.mark.parametrize("cn", ["alipay"], indirect=True)
async def test_a_refund_alipay_does_not_know_is_recorded_without_an_amount(
    keys: dict[str, KeyPair], cn: CnStack
) -> None:
    # Genuine (signed) but naming a refund the refund query does not find: no amount
    # to apply (the gate quarantines it as a mismatch), never the cumulative fee.
    provider, sink, control = cn.provider, cn.sink, cn.control
    request = session_request(sink, amount=500)
    await provider.create_session(request, "k")
    _, trade = await control.post("/_fake/pay", {"out_trade_no": request.order_id})
    now = time.time()
    _, body = notification(
        keys["alipay"],
        now,
        trade_no=trade["trade_no"],
        out_trade_no=request.order_id,
        trade_status="TRADE_SUCCESS",
        out_biz_no="refund-nobody-0",
        refund_fee="5.00",
        gmt_refund=datetime.fromtimestamp(now, CST).strftime(TIME_FORMAT),
    )
    event = parse_notification(provider.alipay, body, now)
    assert event.amount == 500  # the refunded total, before completion
    completed = await AlipayWebhook(provider.alipay, provider).complete(event)
    assert completed.amount is None and completed.refund_id == "refund-nobody-0"
