"""Test helpers for the Alipay and WeChat Pay adapters: RSA keys generated once per
pytest run (never committed), the providers' fakes as real processes on loopback, a
notification sink that verifies with the adapter's own webhook code, and each
provider's set-up as a `CnCase` (what the shared contract tests vary over).
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from ulid import ULID

from gate.base.errors import Encoded
from gate.payments.adapters import verifier_completion
from gate.payments.config import PaymentSettings
from gate.payments.provider import EventInvalid, ProviderError, ProviderEvent, SessionRequest
from gate.payments.providers.alipay import AlipayProvider, AlipayWebhook, load_alipay_settings
from gate.payments.providers.wechatpay import (
    WechatPayProvider,
    WechatPayWebhook,
    load_wechatpay_settings,
)
from gate.payments.signing import WebhookRejected
from tests.support import ServerProcess, base_env, free_port


@dataclass(frozen=True)
class KeyPair:
    private: rsa.RSAPrivateKey
    private_file: str
    public_file: str


def make_key_pair(directory: Path, name: str) -> KeyPair:
    """A fresh 2048-bit RSA pair as PEM files (PKCS#8 private, SPKI public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_file = directory / f"{name}-private.pem"
    public_file = directory / f"{name}-public.pem"
    private_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_file.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return KeyPair(key, str(private_file), str(public_file))


def make_certificate(directory: Path, pair: KeyPair, name: str, serial: int) -> str:
    """A self-signed PEM certificate of `pair`'s key with serial number `serial`
    (as WeChat Pay's platform certificates: the serial is the key's id)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tenpay.com Root CA test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(pair.private.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(pair.private, hashes.SHA256())
    )
    path = directory / f"{name}-cert.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def fake_process(module: str, env: Mapping[str, str]) -> ServerProcess:
    """`python -m tests.fake_<provider> --port N`, a real process on 127.0.0.1."""
    port = free_port()
    return ServerProcess(
        module.rsplit(".", 1)[-1],
        [sys.executable, "-m", module, "--port", str(port)],
        {**base_env(), **env},
        port,
    )


class FakeControl:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = aiohttp.ClientSession()

    async def close(self) -> None:
        await self.http.close()

    async def post(self, path: str, doc: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=doc) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str) -> Any:
        async with self.http.get(self.url + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


class Webhook(Protocol):
    header_names: tuple[str, ...]

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent: ...

    def acknowledge(self, outcome: str) -> Encoded: ...


@dataclass
class Sink:
    """An HTTP endpoint on loopback that receives a fake's notifications, verifies
    them with the adapter's webhook code and answers like the gate (its
    acknowledgement once "recorded"; 401/400 otherwise). `fail_next` answers 500
    that many times first, to see the provider retry."""

    webhook: Webhook
    port: int = field(default_factory=free_port)
    events: list[ProviderEvent] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    fail_next: int = 0
    received: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/notify"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=500, text="busy")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            event = self.webhook.parse(headers, body, time.time())
        except WebhookRejected as exc:
            self.refused.append(str(exc))
            return web.Response(status=401, text=str(exc))
        except EventInvalid as exc:
            self.refused.append(str(exc))
            return web.Response(status=400, text=str(exc))
        complete = verifier_completion(self.webhook)
        if complete is not None:
            try:
                event = await complete(event)
            except ProviderError as exc:
                self.refused.append(str(exc))
                return web.Response(status=503, text=str(exc))
        if event.event_id not in {e.event_id for e in self.events}:
            self.events.append(event)
        status, raw_headers, answer = self.webhook.acknowledge("applied")
        content_type = dict(raw_headers).get(b"content-type", b"").decode() or None
        return web.Response(
            status=status,
            body=answer if status != 204 else None,
            content_type=content_type.split(";")[0] if content_type else None,
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/notify", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def of_type(self, event_type: str, order_id: str) -> list[ProviderEvent]:
        return [e for e in self.events if e.type == event_type and e.order_id == order_id]


async def eventually(predicate: Any, timeout_seconds: float = 15.0) -> Any:
    import asyncio

    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


class StaticWindow:
    """An OrderWindow over a fixed list (the gate's sessions table in e2e tests)."""

    def __init__(self, orders: list[str]) -> None:
        self.orders_list = orders

    async def orders(
        self, provider: str, since: int, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        start = 0 if cursor is None else self.orders_list.index(cursor) + 1
        part = self.orders_list[start : start + limit]
        more = start + limit < len(self.orders_list)
        return part, (part[-1] if more and part else None)


# -- the two providers, as the tests set them up -----------------------------------------

ALIPAY_APP_ID = "2021000000000001"
WECHATPAY_MCHID = "1900009191"
WECHATPAY_APPID = "wxd678efh567hg6787"
WECHATPAY_APIV3_KEY = "a7cde1ZJB1kG2e7VfTs3jQzaWizur8Gb"  # 32 characters, test only
WECHATPAY_SERIAL = "1DDE55AD98ED71D6EDD4A4A16996DE7B47773A8C"
# The WeChat fake's two platform keys: A behind a platform certificate (its serial is
# the id), B in WeChat's public-key mode (PUB_KEY_ID_…).
WECHATPAY_SERIAL_A = "5157F09EFDC096DE15EBE81A47057A72"
WECHATPAY_SERIAL_B = "PUB_KEY_ID_0114232134912410000000000000"
# The fakes retry unacknowledged notifications after these many seconds.
NOTIFY_SCHEDULE = "0.2,0.4,0.8"


def alipay_env(keys: dict[str, KeyPair], url: str, **over: str) -> dict[str, str]:
    return {
        "GATE_ENV": "dev",
        "GATE_ALIPAY_APP_ID": ALIPAY_APP_ID,
        "GATE_ALIPAY_PRIVATE_KEY_FILE": keys["app"].private_file,
        "GATE_ALIPAY_PUBLIC_KEY_FILE": keys["alipay"].public_file,
        "GATE_ALIPAY_GATEWAY_URL": url + "/gateway.do",
        **over,
    }


def wechatpay_env(keys: dict[str, KeyPair], url: str, **over: str) -> dict[str, str]:
    return {
        "GATE_ENV": "dev",
        "GATE_WECHATPAY_MCHID": WECHATPAY_MCHID,
        "GATE_WECHATPAY_APPID": WECHATPAY_APPID,
        "GATE_WECHATPAY_APIV3_KEY": WECHATPAY_APIV3_KEY,
        "GATE_WECHATPAY_PRIVATE_KEY_FILE": keys["merchant"].private_file,
        "GATE_WECHATPAY_CERT_SERIAL": WECHATPAY_SERIAL,
        "GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE": keys["platform"].public_file,
        "GATE_WECHATPAY_API_BASE": url,
        **over,
    }


def cn_pay_settings(provider: str, callback_url: str | None = None) -> PaymentSettings:
    return PaymentSettings(
        provider=provider,
        timeout_seconds=2.0,
        connect_timeout_seconds=0.5,
        retry_max=3,
        callback_url=callback_url,
    )


def _alipay_fake_env(keys: dict[str, KeyPair]) -> dict[str, str]:
    return {
        "FAKE_ALIPAY_APP_ID": ALIPAY_APP_ID,
        "FAKE_ALIPAY_APP_PUBLIC_KEY_FILE": keys["app"].public_file,
        "FAKE_ALIPAY_PRIVATE_KEY_FILE": keys["alipay"].private_file,
        "FAKE_NOTIFY_SCHEDULE": NOTIFY_SCHEDULE,
    }


def _wechatpay_fake_env(keys: dict[str, KeyPair]) -> dict[str, str]:
    return {
        "FAKE_WECHATPAY_MCHID": WECHATPAY_MCHID,
        "FAKE_WECHATPAY_APPID": WECHATPAY_APPID,
        "FAKE_WECHATPAY_APIV3_KEY": WECHATPAY_APIV3_KEY,
        "FAKE_WECHATPAY_MERCHANT_SERIAL": WECHATPAY_SERIAL,
        "FAKE_WECHATPAY_MERCHANT_PUBLIC_KEY_FILE": keys["merchant"].public_file,
        "FAKE_WECHATPAY_PLATFORM_PRIVATE_KEY_FILE": keys["platform"].private_file,
        "FAKE_WECHATPAY_PLATFORM_SERIAL": WECHATPAY_SERIAL_A,
        "FAKE_WECHATPAY_PLATFORM_B_PRIVATE_KEY_FILE": keys["platform_b"].private_file,
        "FAKE_WECHATPAY_PLATFORM_B_SERIAL": WECHATPAY_SERIAL_B,
        "FAKE_NOTIFY_SCHEDULE": NOTIFY_SCHEDULE,
    }


def _alipay(env: Mapping[str, str], notify_url: str) -> tuple[Any, Webhook]:
    alipay = load_alipay_settings(env)
    provider = AlipayProvider(cn_pay_settings(NAME_ALIPAY), alipay)
    return provider, AlipayWebhook(alipay, provider)


def _wechatpay(env: Mapping[str, str], notify_url: str) -> tuple[Any, Webhook]:
    wechat = load_wechatpay_settings(env)
    return WechatPayProvider(cn_pay_settings(NAME_WECHATPAY, notify_url), wechat), (
        WechatPayWebhook(wechat)
    )


@dataclass(frozen=True)
class CnCase:
    """What differs between the Alipay and the WeChat Pay adapter (and their fakes) where
    both keep the same contract (tests/payments/test_payments_cn_contract.py)."""

    name: str
    key_names: tuple[str, ...]
    fake_module: str
    fake_env: Callable[[dict[str, KeyPair]], dict[str, str]]
    env: Callable[..., dict[str, str]]
    build: Callable[[Mapping[str, str], str], tuple[Any, Webhook]]
    # The fake's controls that undo whatever a test configured (the fakes serve the
    # whole session: tests/payments/conftest.py).
    reset: Mapping[str, Any]
    # The fake's control that makes the next calls fail as unavailable (5xx or the
    # provider's "try again" answer).
    failing_calls: str
    # The provider's id of a payment, as the fake's /_fake/pay answers it.
    payment_id_field: str
    redirect_prefix: str
    # The provider's refusals: a second session of a paid order, a refund above
    # what is left.
    paid_again_code: str
    over_refund_code: str
    # Whether a failed payment is notified (Alipay's TRADE_CLOSED) or only queried.
    notifies_failure: bool
    # A refund's status in the refund call's own answer (WeChat settles it after).
    refund_answer_status: str
    # The variable naming the provider's key that signs its answers.
    answer_key_variable: str
    # The key pairs' names: the gate's own (it signs requests) and the provider's
    # (it signs answers and notifications).
    merchant_pair: str
    provider_pair: str

    def keys(self, directory: Path) -> dict[str, KeyPair]:
        return {name: make_key_pair(directory, name) for name in self.key_names}

    def fake(self, keys: dict[str, KeyPair]) -> ServerProcess:
        return fake_process(self.fake_module, self.fake_env(keys))


NAME_ALIPAY, NAME_WECHATPAY = "alipay", "wechatpay"

ALIPAY = CnCase(
    name=NAME_ALIPAY,
    key_names=("app", "alipay", "other"),
    fake_module="tests.fake_alipay",
    fake_env=_alipay_fake_env,
    env=alipay_env,
    build=_alipay,
    reset={"drop_notifications": 0, "drop_refund_notifications": 0, "unavailable_calls": 0},
    failing_calls="unavailable_calls",
    payment_id_field="trade_no",
    redirect_prefix="https://qr.alipay.com/",
    paid_again_code="ACQ.TRADE_HAS_SUCCESS",
    over_refund_code="ACQ.TRADE_STATUS_ERROR",
    notifies_failure=True,
    refund_answer_status="succeeded",
    answer_key_variable="GATE_ALIPAY_PUBLIC_KEY_FILE",
    merchant_pair="app",
    provider_pair="alipay",
)
WECHATPAY = CnCase(
    name=NAME_WECHATPAY,
    key_names=("merchant", "platform", "platform_b", "other"),
    fake_module="tests.fake_wechatpay",
    fake_env=_wechatpay_fake_env,
    env=wechatpay_env,
    build=_wechatpay,
    reset={
        "drop_notifications": 0,
        "drop_refund_notifications": 0,
        "failing_calls": 0,
        "refund_outcome": "SUCCESS",
        "platform_key": "a",
    },
    failing_calls="failing_calls",
    payment_id_field="transaction_id",
    redirect_prefix="weixin://wxpay/bizpayurl?pr=",
    paid_again_code="ORDERPAID",
    over_refund_code="NOT_ENOUGH",
    notifies_failure=False,
    refund_answer_status="pending",
    answer_key_variable="GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE",
    merchant_pair="merchant",
    provider_pair="platform",
)
CASES = {c.name: c for c in (ALIPAY, WECHATPAY)}


@dataclass
class CnStack:
    """One adapter against its fake: the provider, a notification sink verifying with
    the adapter's webhook, the fake's controls."""

    case: CnCase
    keys: dict[str, KeyPair]
    fake: ServerProcess
    provider: Any
    sink: Sink
    control: FakeControl


@asynccontextmanager
async def cn_stack(
    case: CnCase, keys: dict[str, KeyPair], fake: ServerProcess, **env_over: str
) -> AsyncIterator[CnStack]:
    port = free_port()
    provider, webhook = case.build(
        case.env(keys, fake.url, **env_over), f"http://127.0.0.1:{port}/notify"
    )
    sink = Sink(webhook, port=port)
    await sink.start()
    control = FakeControl(fake.url)
    await control.post("/_fake/configure", dict(case.reset))
    try:
        yield CnStack(case, keys, fake, provider, sink, control)
    finally:
        await provider.close()
        await sink.stop()
        await control.close()


def session_request(sink: Sink, amount: int = 8888, **over: Any) -> SessionRequest:
    fields: dict[str, Any] = {
        "order_id": str(ULID()),
        "amount": amount,
        "currency": "CNY",
        "capture_mode": "automatic",
        "expires_at": int(time.time()) + 600,
        "description": "flash sale",
        "notify_url": sink.url,
    }
    fields.update(over)
    return SessionRequest(**fields)
