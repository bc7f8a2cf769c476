"""The WeChat Pay v3 adapter: request signatures and the Authorization header as
documented, answer and notification signatures (±300 s), AEAD_AES_256_GCM
resources, start-up settings, several platform keys, ids checked, and what only
WeChat Pay does against its fake (refunds settled after the answer, requests signed
with another key refused, a platform key rotation). The contract WeChat Pay and
Alipay both keep against their fakes is tests/payments/test_payments_cn_contract.py."""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from ulid import ULID

from gate.base.settings import Secret, SettingsError
from gate.payments.config import PaymentSettings
from gate.payments.provider import (
    EventInvalid,
    ProviderRejected,
    ProviderUnavailable,
)
from gate.payments.providers.rsa_http import sign_sha256_rsa
from gate.payments.providers.wechatpay import (
    WechatPayProvider,
    WechatPaySettings,
    WechatPayWebhook,
    answer_message,
    authorization,
    decrypt_resource,
    encrypt_resource,
    load_wechatpay_settings,
    parse_authorization,
    parse_notification,
    request_message,
)
from gate.payments.signing import WebhookRejected
from tests.cn_support import (
    WECHATPAY_APIV3_KEY,
    WECHATPAY_APPID,
    WECHATPAY_MCHID,
    WECHATPAY_SERIAL,
    WECHATPAY_SERIAL_A,
    WECHATPAY_SERIAL_B,
    CnStack,
    FakeControl,
    KeyPair,
    Sink,
    cn_pay_settings,
    eventually,
    make_certificate,
    session_request,
    wechatpay_env,
)
from tests.support import ServerProcess

MCHID = WECHATPAY_MCHID
APPID = WECHATPAY_APPID
APIV3_KEY = WECHATPAY_APIV3_KEY
SERIAL = WECHATPAY_SERIAL
SERIAL_A = WECHATPAY_SERIAL_A
SERIAL_B = WECHATPAY_SERIAL_B
env_for = wechatpay_env


def pay_settings(callback_url: str | None = None) -> PaymentSettings:
    return cn_pay_settings("wechatpay", callback_url)


@pytest.fixture(scope="module")
def keys(cn_keys: dict[str, dict[str, KeyPair]]) -> dict[str, KeyPair]:
    return cn_keys["wechatpay"]


@pytest.fixture(scope="module")
def fake(cn_fakes: dict[str, ServerProcess]) -> ServerProcess:
    return cn_fakes["wechatpay"]


# -- signatures, resources, settings ----------------------------------------------------


def test_request_message_and_header_are_the_documented_ones(keys: dict[str, KeyPair]) -> None:
    # WeChat Pay's "签名生成" page: GET /v3/certificates at 1554208460 with nonce
    # 593BEC0C930BF1AFEB40B4A08C8FB242 signs exactly these bytes (empty body: an
    # empty line). The page's signature value belongs to a private key it does not
    # publish, so the signature is checked with our own test key.
    message = request_message(
        "GET", "/v3/certificates", "1554208460", "593BEC0C930BF1AFEB40B4A08C8FB242", b""
    )
    assert message == b"GET\n/v3/certificates\n1554208460\n593BEC0C930BF1AFEB40B4A08C8FB242\n\n"
    header = authorization(
        keys["merchant"].private,
        MCHID,
        SERIAL,
        "GET",
        "/v3/certificates",
        b"",
        timestamp="1554208460",
        nonce="593BEC0C930BF1AFEB40B4A08C8FB242",
    )
    assert header.startswith('WECHATPAY2-SHA256-RSA2048 mchid="1900009191",nonce_str=')
    fields = parse_authorization(header)
    assert fields["serial_no"] == SERIAL and fields["timestamp"] == "1554208460"
    keys["merchant"].private.public_key().verify(
        base64.b64decode(fields["signature"]), message, padding.PKCS1v15(), hashes.SHA256()
    )


def test_settings_name_the_missing_variable(keys: dict[str, KeyPair], tmp_path: Path) -> None:
    for name in env_for(keys, "http://x"):
        if name in ("GATE_ENV", "GATE_WECHATPAY_API_BASE"):
            continue
        env = env_for(keys, "http://x")
        del env[name]
        with pytest.raises(SettingsError, match=name):
            load_wechatpay_settings(env)
    with pytest.raises(SettingsError, match="GATE_WECHATPAY_APIV3_KEY"):
        load_wechatpay_settings(env_for(keys, "http://x", GATE_WECHATPAY_APIV3_KEY="short"))
    bad = tmp_path / "bad.pem"
    bad.write_text("nope")
    with pytest.raises(SettingsError, match="GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE"):
        load_wechatpay_settings(
            env_for(keys, "http://x", GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE=str(bad))
        )
    env = env_for(keys, "http://wechat.example")
    env["GATE_ENV"] = "production"
    with pytest.raises(SettingsError, match="GATE_WECHATPAY_API_BASE"):
        load_wechatpay_settings(env)
    settings = load_wechatpay_settings(env_for(keys, "http://x"))
    assert APIV3_KEY not in repr(settings) and APIV3_KEY not in str(settings.apiv3_key)


def settings_of(keys: dict[str, KeyPair]) -> WechatPaySettings:
    return load_wechatpay_settings(env_for(keys, "http://127.0.0.1:1"))


def notification(
    keys: dict[str, KeyPair],
    now: float,
    *,
    event_type: str = "TRANSACTION.SUCCESS",
    signer: str = "platform",
    apiv3_key: str = APIV3_KEY,
    resource: dict[str, Any] | None = None,
    serial: str = SERIAL_A,
) -> tuple[dict[str, str], bytes]:
    plain = resource or {
        "mchid": MCHID,
        "appid": APPID,
        "out_trade_no": str(ULID()),
        "transaction_id": "4200000000202612010000000001",
        "trade_state": "SUCCESS",
        "success_time": "2026-12-01T17:00:00+08:00",
        "amount": {"total": 8888, "payer_total": 8888, "currency": "CNY"},
    }
    nonce = "fdasflkja484"
    body = orjson.dumps(
        {
            "id": "EV-2018022511223320873",
            "create_time": "2026-12-01T17:00:00+08:00",
            "resource_type": "encrypt-resource",
            "event_type": event_type,
            "summary": "支付成功",
            "resource": {
                "original_type": "transaction",
                "algorithm": "AEAD_AES_256_GCM",
                "ciphertext": encrypt_resource(
                    apiv3_key, orjson.dumps(plain), nonce, "transaction"
                ),
                "associated_data": "transaction",
                "nonce": nonce,
            },
        }
    )
    ts, wnonce = str(int(now)), "5K8264ILTKCH16CQ2502SI8ZNMTM67VS"
    headers = {
        "wechatpay-timestamp": ts,
        "wechatpay-nonce": wnonce,
        "wechatpay-signature": sign_sha256_rsa(
            keys[signer].private, answer_message(ts, wnonce, body)
        ),
        "wechatpay-serial": serial,
    }
    return headers, body


def test_genuine_notification_decrypts_to_a_payment(keys: dict[str, KeyPair]) -> None:
    now = time.time()
    headers, body = notification(keys, now)
    event = parse_notification(settings_of(keys), headers, body, now)
    assert event.type == "payment.succeeded"
    assert (event.amount, event.currency) == (8888, "CNY")
    assert event.payment_id == "4200000000202612010000000001"
    assert event.payload == body


@pytest.mark.parametrize(
    "change",
    ["forged", "tampered", "stale", "ahead", "other_key", "no_signature", "nonce"],
)
def test_notification_refused(keys: dict[str, KeyPair], change: str) -> None:
    now = time.time()
    when = now - 301 if change == "stale" else now + 301 if change == "ahead" else now
    headers, body = notification(
        keys,
        when,
        signer="other" if change == "forged" else "platform",
        apiv3_key="b" * 32 if change == "other_key" else APIV3_KEY,
    )
    if change == "tampered":
        body = body.replace(b"EV-2018", b"EV-2019")
    elif change == "no_signature":
        del headers["wechatpay-signature"]
    elif change == "nonce":
        headers["wechatpay-nonce"] = "another-nonce"
    with pytest.raises(WebhookRejected):
        parse_notification(settings_of(keys), headers, body, now)


@pytest.mark.parametrize("field", ["mchid", "appid"])
def test_another_merchants_genuine_notification_names_no_order(
    keys: dict[str, KeyPair], field: str
) -> None:
    # Signed by WeChat, encrypted with our APIv3 key, for another merchant or app:
    # recorded and quarantined (no order id), not refused.
    now = time.time()
    resource = {
        "mchid": MCHID,
        "appid": APPID,
        "out_trade_no": str(ULID()),
        "transaction_id": "4200000000202612010000000002",
        "amount": {"total": 1, "currency": "CNY"},
        field: "1900000002" if field == "mchid" else "wxother0000000000",
    }
    headers, body = notification(keys, now, resource=resource)
    event = parse_notification(settings_of(keys), headers, body, now)
    assert event.order_id is None and event.type == "payment.succeeded"


def test_genuine_but_unreadable_is_400(keys: dict[str, KeyPair]) -> None:
    now = time.time()
    headers, body = notification(
        keys, now, resource={"mchid": MCHID, "out_trade_no": "x", "amount": {"total": 1}}
    )
    with pytest.raises(EventInvalid):
        parse_notification(settings_of(keys), headers, body, now)


# -- against the fake: what only WeChat Pay does ----------------------------------------


@pytest.mark.parametrize("cn", ["wechatpay"], indirect=True)
async def test_abnormal_refund_is_a_failed_refund(
    cn: CnStack,
) -> None:
    provider, sink, control = cn.provider, cn.sink, cn.control
    await control.post("/_fake/configure", {"refund_outcome": "ABNORMAL"})
    request = session_request(sink, amount=300)
    await provider.create_session(request, "k")
    _, tx = await control.post("/_fake/pay", {"out_trade_no": request.order_id})
    refund = await provider.refund(tx["transaction_id"], 300, "refund-x-0")
    # Answered PROCESSING (WeChat settles refunds after the answer); the outcome
    # comes by notification, or by asking again with the same out_refund_no.
    assert refund.status == "pending"
    assert (await provider.refund(tx["transaction_id"], 300, "refund-x-0")).status == "failed"
    await eventually(lambda: sink.of_type("refund.failed", request.order_id))


async def test_requests_signed_with_another_key_are_refused(
    keys: dict[str, KeyPair], fake: ServerProcess
) -> None:
    wechat = load_wechatpay_settings(
        env_for(keys, fake.url, GATE_WECHATPAY_PRIVATE_KEY_FILE=keys["other"].private_file)
    )
    provider = WechatPayProvider(pay_settings("http://127.0.0.1:1/n"), wechat)
    try:
        with pytest.raises(ProviderRejected) as refused:
            await provider.payments_for_order(str(ULID()))
        assert (refused.value.status, refused.value.code) == (401, "SIGN_ERROR")
    finally:
        await provider.close()


def test_wechat_pays_own_aes_gcm_vector() -> None:
    # The AEAD_AES_256_GCM test vector of WeChat Pay's official Go SDK
    # (github.com/wechatpay-apiv3/wechatpay-go, utils/aes_test.go). Its key is 16
    # bytes (AES-128: the same GCM construction); a real APIv3 key is 32.
    resource = {
        "algorithm": "AEAD_AES_256_GCM",
        "ciphertext": "FsdXzxryWfKwvLJKf8LG/ToRPTRh8RN9wROC",
        "nonce": "wCq51qZv4Yfg",
        "associated_data": "Dl56FrqWQJF1t9LtC3vEUsniZKvbqdR8",
    }
    assert decrypt_resource(Secret("testAPIv3Key0000"), resource) == b"Hello World"
    with pytest.raises(WebhookRejected):
        decrypt_resource(Secret("testAPIv3Key1111"), resource)
    with pytest.raises(WebhookRejected):
        decrypt_resource(Secret("testAPIv3Key0000"), {**resource, "associated_data": "x"})


# -- several platform keys, selected by Wechatpay-Serial --------------------------------


def keyset_env(keys: dict[str, KeyPair], url: str, **over: str) -> dict[str, str]:
    """The settings without the single-key variable: the keys come from `over`."""
    env = env_for(keys, url, **over)
    if "GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE" not in over:
        del env["GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE"]
    return env


@pytest.fixture(scope="module")
def cert_a(keys: dict[str, KeyPair], tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_certificate(
        tmp_path_factory.mktemp("wechatpay-certs"), keys["platform"], "a", int(SERIAL_A, 16)
    )


def both_keys(keys: dict[str, KeyPair], cert_a: str) -> str:
    return f"{cert_a}, {SERIAL_B}={keys['platform_b'].public_file}"


def verifies(wechat: WechatPaySettings, keys: dict[str, KeyPair], signer: str, serial: str) -> bool:
    now = time.time()
    headers, body = notification(keys, now, signer=signer, serial=serial)
    try:
        parse_notification(wechat, headers, body, now)
    except WebhookRejected:
        return False
    return True


def test_platform_keys_are_selected_by_wechatpay_serial(
    keys: dict[str, KeyPair], cert_a: str
) -> None:
    both = load_wechatpay_settings(
        keyset_env(keys, "http://x", GATE_WECHATPAY_PLATFORM_KEY_FILES=both_keys(keys, cert_a))
    )
    # A certificate's id is its serial number; a bare key's, the id written before it.
    assert set(both.platform_keys.by_id) == {SERIAL_A, SERIAL_B}
    assert both.platform_keys.anonymous is None
    assert verifies(both, keys, "platform", SERIAL_A)
    assert verifies(both, keys, "platform", SERIAL_A.lower())  # hex in either case
    assert verifies(both, keys, "platform", "00" + SERIAL_A)  # a number: padding aside
    assert verifies(both, keys, "platform_b", SERIAL_B)
    # The serial chooses the key: B's signature under A's serial does not verify.
    assert not verifies(both, keys, "platform_b", SERIAL_A)
    assert not verifies(both, keys, "platform", SERIAL_B)
    for serial in ("ABCDEF0123", "PUB_KEY_ID_99", "", SERIAL_A + "\n", "PUB_KEY_ID_\u00e9", "é"):
        now = time.time()
        headers, body = notification(keys, now, serial=serial)
        with pytest.raises(WebhookRejected, match="Wechatpay-Serial"):
            parse_notification(both, headers, body, now)
    headers, body = notification(keys, time.time())
    del headers["wechatpay-serial"]
    with pytest.raises(WebhookRejected, match="Wechatpay-Serial"):
        parse_notification(both, headers, body, time.time())

    only_a = load_wechatpay_settings(
        keyset_env(keys, "http://x", GATE_WECHATPAY_PLATFORM_KEY_FILES=cert_a)
    )
    assert verifies(only_a, keys, "platform", SERIAL_A)
    assert not verifies(only_a, keys, "platform_b", SERIAL_B)


def test_the_single_key_variable_keeps_working(keys: dict[str, KeyPair], cert_a: str) -> None:
    # A bare public key without an id verifies whatever serial is named (as before
    # several keys could be configured); beside it, the listed keys are chosen by id.
    legacy = settings_of(keys)
    assert legacy.platform_keys.by_id == {} and legacy.platform_keys.anonymous is not None
    assert verifies(legacy, keys, "platform", SERIAL_A)
    assert verifies(legacy, keys, "platform", "0123ABCD")
    mixed = load_wechatpay_settings(
        env_for(
            keys,
            "http://x",
            GATE_WECHATPAY_PLATFORM_KEY_FILES=f"{SERIAL_B}={keys['platform_b'].public_file}",
        )
    )
    assert verifies(mixed, keys, "platform_b", SERIAL_B)
    assert verifies(mixed, keys, "platform", SERIAL_A)
    assert not verifies(mixed, keys, "platform", SERIAL_B)
    # A certificate in the single variable is keyed by its serial.
    cert = load_wechatpay_settings(
        env_for(keys, "http://x", GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE=cert_a)
    )
    assert set(cert.platform_keys.by_id) == {SERIAL_A} and cert.platform_keys.anonymous is None
    assert not verifies(cert, keys, "platform", "0123ABCD")
    # A bare key with its id.
    by_id = load_wechatpay_settings(
        env_for(
            keys,
            "http://x",
            GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE=keys["platform_b"].public_file,
            GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_ID=SERIAL_B,
        )
    )
    assert verifies(by_id, keys, "platform_b", SERIAL_B)
    assert not verifies(by_id, keys, "platform_b", SERIAL_A)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{b}", "bare public key"),
        ("not an id={b}", "not a platform certificate serial"),
        ("{a}, 5157F09EFDC096DE15EBE81A47057A72={b}", "configured twice"),
        (",".join(["{a}"] * 17), "at most 16"),
        ("PUB_KEY_ID_1=/nonexistent.pem", "cannot read"),
    ],
)
def test_bad_platform_key_lists_name_the_variable(
    keys: dict[str, KeyPair], cert_a: str, value: str, message: str
) -> None:
    listed = value.format(a=cert_a, b=keys["platform_b"].public_file)
    with pytest.raises(SettingsError, match=message) as refused:
        load_wechatpay_settings(
            keyset_env(keys, "http://x", GATE_WECHATPAY_PLATFORM_KEY_FILES=listed)
        )
    assert "GATE_WECHATPAY_PLATFORM_KEY_FILES" in str(refused.value)


async def test_a_key_rotation_verifies_with_both_keys_and_only_with_both(
    keys: dict[str, KeyPair], fake: ServerProcess, cert_a: str
) -> None:
    both = load_wechatpay_settings(
        keyset_env(keys, fake.url, GATE_WECHATPAY_PLATFORM_KEY_FILES=both_keys(keys, cert_a))
    )
    only_a = load_wechatpay_settings(
        keyset_env(keys, fake.url, GATE_WECHATPAY_PLATFORM_KEY_FILES=cert_a)
    )
    sink_both, sink_a = Sink(WechatPayWebhook(both)), Sink(WechatPayWebhook(only_a))
    await sink_both.start()
    await sink_a.start()
    provider = WechatPayProvider(pay_settings(sink_both.url), both)
    provider_a = WechatPayProvider(pay_settings(sink_a.url), only_a)
    control = FakeControl(fake.url)
    await control.post("/_fake/configure", {"platform_key": "a", "drop_notifications": 0})

    async def paid(sink: Sink) -> str:
        request = session_request(sink, amount=321)
        await provider.create_session(request, "k")
        await control.post("/_fake/pay", {"out_trade_no": request.order_id})
        return request.order_id

    try:
        # Before the rotation: both gates verify the certificate key's notifications.
        first = await paid(sink_both)
        first_a = await paid(sink_a)
        await eventually(lambda: sink_both.of_type("payment.succeeded", first))
        await eventually(lambda: sink_a.of_type("payment.succeeded", first_a))
        assert await provider_a.payments_for_order(first_a) != []

        await control.post("/_fake/configure", {"platform_key": "b"})
        second = await paid(sink_both)
        second_a = await paid(sink_a)
        # With both keys: the public-key id's notification and answers verify.
        [event] = await eventually(lambda: sink_both.of_type("payment.succeeded", second))
        assert event.amount == 321
        [payment] = await provider.payments_for_order(second)
        assert payment.status == "succeeded"
        # With only A: refused as naming no configured key, answers not believed.
        await eventually(lambda: len(sink_a.refused) >= 2)
        assert all("names no configured platform key" in r for r in sink_a.refused)
        assert sink_a.of_type("payment.succeeded", second_a) == []
        with pytest.raises(ProviderUnavailable, match="Wechatpay-Serial"):
            await provider_a.payments_for_order(second_a)
    finally:
        await control.post("/_fake/configure", {"platform_key": "a"})
        await control.close()
        await provider.close()
        await provider_a.close()
        await sink_both.stop()
        await sink_a.stop()


# -- ids checked whole ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("out_refund_no", "refund wechat"),
        ("out_refund_no", "r" * 65),
        ("out_refund_no", "refund-x\n"),
        ("event_type", "REFUND.SUCCESS\n"),
        ("event_type", "refund.success"),
    ],
)
def test_refund_ids_and_event_types_outside_the_alphabet_are_400(
    keys: dict[str, KeyPair], field: str, value: str
) -> None:
    now = time.time()
    resource = {
        "mchid": MCHID,
        "out_trade_no": str(ULID()),
        "transaction_id": "4200000000202612010000000003",
        "out_refund_no": value if field == "out_refund_no" else "refund-wechatpay-x-0",
        "refund_status": "SUCCESS",
        "amount": {"total": 1, "refund": 1, "currency": "CNY"},
    }
    event_type = value if field == "event_type" else "REFUND.SUCCESS"
    headers, body = notification(keys, now, event_type=event_type, resource=resource)
    with pytest.raises(EventInvalid, match=field):
        parse_notification(settings_of(keys), headers, body, now)


@pytest.mark.parametrize(
    "header", ["wechatpay-signature", "wechatpay-nonce", "wechatpay-timestamp"]
)
def test_header_bytes_outside_ascii_are_a_rejection(keys: dict[str, KeyPair], header: str) -> None:
    # As a server hands them over (latin-1 text of the raw bytes): a rejection (401),
    # never an error.
    now = time.time()
    headers, body = notification(keys, now)
    headers[header] = "\u00c3\u00a9" + headers[header][2:]
    with pytest.raises(WebhookRejected):
        parse_notification(settings_of(keys), headers, body, now)
