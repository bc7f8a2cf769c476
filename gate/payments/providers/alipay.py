"""Alipay (open platform, RSA2) as a gate payment provider.

    session ──alipay.trade.precreate (out_trade_no = order id, time_expire = hold end)──> qr_code
    buyer pays ──> Alipay ──POST form notify_url (trade_status_sync, RSA2-signed)──> gate
        verify (params sorted, sign/sign_type left out, SHA256withRSA with Alipay's key,
        app_id ours, notify_time within ±300 s) ──> ProviderEvent ──> recorded ──> "success"
    refund ──alipay.trade.refund (out_request_no = the gate's refund key)──> then
        alipay.trade.fastpay.refund.query for its status
    reconcile ──alipay.trade.query per order of the window (no listing API)

Every request is a form POST to the gateway with the common parameters and
`biz_content` (JSON), signed over the sorted `k=v` pairs (no `sign`); every answer
is `{"<method>_response": {...}, "sign": "..."}` with the signature over the exact
text of the `<method>_response` value, verified before anything in it is used.

Mapping (trade_status → gate events), amounts yuan strings → fen exactly:
    TRADE_SUCCESS / TRADE_FINISHED, no refund fields  -> payment.succeeded
    any status with out_biz_no / gmt_refund / refund_fee -> refund.succeeded
        (refund_id = out_biz_no, our out_request_no; amount = that refund's own
        amount: refund_fee is the trade's refunded total so far, so the amount is
        asked of alipay.trade.fastpay.refund.query before the event is recorded)
    TRADE_CLOSED without refund fields (unpaid trade closed) -> payment.failed
Alipay's authorize-then-capture is a different product (alipay.fund.auth.*, 预授权):
not supported; a manual-capture session is refused (422 capture_unsupported).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import orjson
from cryptography.hazmat.primitives.asymmetric import rsa

from gate.base.errors import Encoded, encode_answer
from gate.base.settings import SettingsError
from gate.payments.adapters import Adapter, AdapterContext
from gate.payments.config import PaymentSettings, is_loopback_host
from gate.payments.provider import (
    ID_MAX,
    EventInvalid,
    Payment,
    ProviderEvent,
    ProviderRejected,
    ProviderUnavailable,
    Refund,
    Session,
    SessionRequest,
    Transaction,
    TransactionPage,
    answer_id,
    event_id_of,
    order_id_or_none,
)
from gate.payments.providers.provider_http import ProviderHttp
from gate.payments.providers.rsa_http import (
    fen_to_yuan,
    provider_key,
    read_private_key,
    read_public_key,
    sign_sha256_rsa,
    verify_sha256_rsa,
    yuan_to_fen,
)
from gate.payments.signing import WebhookRejected
from gate.payments.window import OrderWindow

NAME = "alipay"
GATEWAY_URL = "https://openapi.alipay.com/gateway.do"
CURRENCY = "CNY"
TOLERANCE_SECONDS = 300
NOTIFY_PARAMS_MAX = 100
# Alipay writes its times in China Standard Time, without a zone.
CST = timezone(timedelta(hours=8))
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
# The answer Alipay needs, as the whole body, to stop retrying a notification.
ACK_BODY = b"success"
SUCCESS_CODE = "10000"
# Alipay's "service unavailable" (HTTP 200): transient, retried with the same request.
UNAVAILABLE_CODE = "20000"
PAID = ("TRADE_SUCCESS", "TRADE_FINISHED")
# Alipay's documented formats: trade_no String(64) of digits; out_request_no /
# out_biz_no String(64) (the gate's own keys: [0-9A-Za-z_-], rsa_http.provider_key);
# trade_status an upper-case word such as TRADE_SUCCESS.
TRADE_NO_RE = re.compile(r"[0-9]{1,64}")
REQUEST_NO_RE = re.compile(r"[0-9A-Za-z_\-]{1,64}")
TRADE_STATUS_RE = re.compile(r"[A-Z_]{1,32}")


@dataclass(frozen=True)
class AlipaySettings:
    app_id: str
    private_key: rsa.RSAPrivateKey
    alipay_public_key: rsa.RSAPublicKey
    gateway_url: str = GATEWAY_URL

    def __repr__(self) -> str:
        return f"AlipaySettings(app_id={self.app_id!r}, gateway_url={self.gateway_url!r})"


def load_alipay_settings(env: Mapping[str, str]) -> AlipaySettings:
    """Every required variable present and readable, or SettingsError naming it."""
    values = {}
    for name in (
        "GATE_ALIPAY_APP_ID",
        "GATE_ALIPAY_PRIVATE_KEY_FILE",
        "GATE_ALIPAY_PUBLIC_KEY_FILE",
    ):
        raw = env.get(name, "").strip()
        if not raw:
            raise SettingsError(f"{name} is required with GATE_PAYMENT_PROVIDER=alipay")
        values[name] = raw
    app_id = values["GATE_ALIPAY_APP_ID"]
    if not app_id.isdigit() or len(app_id) > 32:
        raise SettingsError(
            "GATE_ALIPAY_APP_ID must be Alipay's numeric app id (at most 32 digits)"
        )
    gateway = env.get("GATE_ALIPAY_GATEWAY_URL", "").strip() or GATEWAY_URL
    parts = urlsplit(gateway)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"GATE_ALIPAY_GATEWAY_URL must be an http(s) URL, got {gateway!r}")
    dev = env.get("GATE_ENV", "production").strip().lower() == "dev"
    if parts.scheme != "https" and not dev and not is_loopback_host(parts.hostname):
        raise SettingsError(
            "GATE_ALIPAY_GATEWAY_URL must be https:// outside GATE_ENV=dev"
            " (plain http only to a loopback address)"
        )
    return AlipaySettings(
        app_id=app_id,
        private_key=read_private_key(
            "GATE_ALIPAY_PRIVATE_KEY_FILE", values["GATE_ALIPAY_PRIVATE_KEY_FILE"]
        ),
        alipay_public_key=read_public_key(
            "GATE_ALIPAY_PUBLIC_KEY_FILE", values["GATE_ALIPAY_PUBLIC_KEY_FILE"]
        ),
        gateway_url=gateway,
    )


def signing_string(params: Mapping[str, str], *, notification: bool = False) -> bytes:
    """Alipay's content to sign: every parameter with a non-empty value but `sign`
    (and, on an asynchronous notification, `sign_type` too), sorted by name, as
    `k=v` joined by `&`, values raw (not URL-encoded), UTF-8. Requests sign their
    `sign_type=RSA2`; notifications leave it out (Alipay's two documented rules)."""
    skip = ("sign", "sign_type") if notification else ("sign",)
    pairs = sorted((k, v) for k, v in params.items() if k not in skip and v != "")
    return "&".join(f"{k}={v}" for k, v in pairs).encode()


def sign_params(key: rsa.RSAPrivateKey, params: Mapping[str, str]) -> str:
    """A request's `sign`."""
    return sign_sha256_rsa(key, signing_string(params))


def verify_notification_params(key: rsa.RSAPublicKey, params: Mapping[str, str]) -> bool:
    return verify_sha256_rsa(key, signing_string(params, notification=True), params.get("sign", ""))


def response_content(raw: bytes, method: str) -> tuple[bytes, dict[str, Any], str]:
    """The exact bytes of `<method>_response` (what Alipay signed), its parsed value
    and the `sign` beside it. Raises ValueError when the answer has no such part."""
    text = raw.decode("utf-8")
    doc = json.loads(text)
    name = method.replace(".", "_") + "_response"
    if not isinstance(doc, dict):
        raise ValueError("the answer is not an object")
    if name not in doc:
        name = "error_response"
    value = doc.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"the answer has no {name}")
    # Find the value's text: the key's position, then raw_decode from the value start
    # gives its end; Alipay signs those characters exactly.
    at = text.find(f'"{name}"')
    colon = text.index(":", at + len(name) + 2)
    start = colon + 1
    while text[start] in " \t\r\n":
        start += 1
    _, end = json.JSONDecoder().raw_decode(text, start)
    sign = doc.get("sign")
    return text[start:end].encode(), value, sign if isinstance(sign, str) else ""


class AlipayProvider:
    """The Provider interface (gate/payments/provider.py) over Alipay's open API."""

    name = NAME

    def __init__(
        self,
        settings: PaymentSettings,
        alipay: AlipaySettings,
        window: OrderWindow | None = None,
    ) -> None:
        self.settings = settings
        self.alipay = alipay
        self.window = window
        self.http = ProviderHttp(settings, NAME)

    async def close(self) -> None:
        await self.http.close()

    # -- requests -----------------------------------------------------------------

    def _params(self, method: str, biz: dict[str, Any], notify_url: str | None) -> dict[str, str]:
        params = {
            "app_id": self.alipay.app_id,
            "method": method,
            "format": "JSON",
            "charset": "utf-8",
            "sign_type": "RSA2",
            "timestamp": datetime.now(CST).strftime(TIME_FORMAT),
            "version": "1.0",
            "biz_content": orjson.dumps(biz).decode(),
        }
        if notify_url:
            params["notify_url"] = notify_url
        params["sign"] = sign_params(self.alipay.private_key, params)
        return params

    async def _call(
        self, method: str, biz: dict[str, Any], notify_url: str | None = None
    ) -> dict[str, Any]:
        """The verified `<method>_response` whatever its code (the caller reads
        code/sub_code); ProviderUnavailable when no verified answer came back."""
        body = urlencode(self._params(method, biz, notify_url)).encode()

        def transient(status: int, raw: bytes) -> bool:
            return status == 200 and f'"code":"{UNAVAILABLE_CODE}"'.encode() in raw

        answer = await self.http.request(
            "POST",
            self.alipay.gateway_url,
            body,
            {"Content-Type": "application/x-www-form-urlencoded;charset=utf-8"},
            transient=transient,
            what=method,
        )
        status, raw = answer.status, answer.raw
        if status != 200:
            raise ProviderUnavailable(f"alipay {method}: HTTP {status}")
        try:
            content, value, sign = response_content(raw, method)
        except (ValueError, UnicodeDecodeError):
            raise ProviderUnavailable(f"alipay {method}: unreadable answer") from None
        # Alipay signs its answers (errors about our own signature may come unsigned:
        # those are refusals either way and carry nothing we act on).
        if sign:
            if not verify_sha256_rsa(self.alipay.alipay_public_key, content, sign):
                raise ProviderUnavailable(f"alipay {method}: answer signature does not verify")
        elif value.get("code") == SUCCESS_CODE:
            raise ProviderUnavailable(f"alipay {method}: unsigned success answer")
        return value

    @staticmethod
    def _refused(method: str, value: dict[str, Any]) -> ProviderRejected:
        code = str(value.get("sub_code") or value.get("code") or "error")
        return ProviderRejected(
            400, code[:64], f"alipay {method}: {value.get('sub_msg') or value.get('msg')}", value
        )

    # -- the interface ------------------------------------------------------------

    async def create_session(self, request: SessionRequest, key: str) -> Session:
        if request.capture_mode != "automatic":
            raise ProviderRejected(
                422,
                "capture_unsupported",
                "Alipay has no authorize-then-capture in the trade API (pre-authorization"
                " is a separate product this gate does not support)",
            )
        if request.currency != CURRENCY:
            raise ProviderRejected(422, "currency_unsupported", "Alipay takes CNY only")
        # precreate is idempotent by out_trade_no: the same request answers the same
        # QR code, so the retry loop and a repeated session call are safe.
        biz = {
            "out_trade_no": request.order_id,
            "total_amount": fen_to_yuan(request.amount),
            "subject": request.description[:256] or request.order_id,
            "time_expire": datetime.fromtimestamp(request.expires_at, CST).strftime(TIME_FORMAT),
        }
        value = await self._call(
            "alipay.trade.precreate", biz, request.notify_url or self.settings.callback_url
        )
        if value.get("code") != SUCCESS_CODE or not isinstance(value.get("qr_code"), str):
            raise self._refused("alipay.trade.precreate", value)
        return Session(
            session_id=request.order_id,
            order_id=request.order_id,
            redirect_url=value["qr_code"],
            expires_at=request.expires_at,
            status="open",
        )

    async def find_session(self, order_id: str) -> Session | None:
        # A precreated QR code cannot be looked up; create_session is idempotent.
        return None

    async def _query(self, biz: dict[str, str]) -> dict[str, Any] | None:
        value = await self._call("alipay.trade.query", biz)
        if value.get("code") == SUCCESS_CODE:
            return value
        if value.get("sub_code") == "ACQ.TRADE_NOT_EXIST":
            return None
        raise self._refused("alipay.trade.query", value)

    async def payments_for_order(self, order_id: str) -> list[Payment]:
        trade = await self._query({"out_trade_no": order_id})
        payment = _payment(trade) if trade is not None else None
        return [payment] if payment is not None else []

    async def get_payment(self, payment_id: str) -> Payment | None:
        trade = await self._query({"trade_no": payment_id})
        return _payment(trade) if trade is not None else None

    async def capture(self, payment_id: str, amount: int, key: str) -> Payment:
        raise ProviderRejected(422, "capture_unsupported", "Alipay trades are captured at payment")

    async def void(self, payment_id: str, key: str) -> Payment:
        raise ProviderRejected(422, "void_unsupported", "Alipay trades have no authorization")

    async def refund(self, payment_id: str, amount: int, key: str) -> Refund:
        request_no = provider_key(key)
        value = await self._call(
            "alipay.trade.refund",
            {
                "trade_no": payment_id,
                "refund_amount": fen_to_yuan(amount),
                "out_request_no": request_no,
            },
        )
        if value.get("code") != SUCCESS_CODE:
            raise self._refused("alipay.trade.refund", value)
        order_id = order_id_or_none(value.get("out_trade_no"))
        # The refund answer's fund_change is "N" for a repeated out_request_no; the
        # refund query says what the refund is now either way.
        status = await self._refund_status(payment_id, request_no)
        return Refund(
            refund_id=request_no,
            payment_id=payment_id,
            order_id=order_id,
            amount=amount,
            currency=CURRENCY,
            status=status,
        )

    async def refund_amount(self, payment_id: str, request_no: str) -> int | None:
        """The amount of one settled refund of a trade (refund_amount of
        alipay.trade.fastpay.refund.query: this refund's, not the trade's total), or
        None when Alipay knows no such settled refund."""
        value = await self._call(
            "alipay.trade.fastpay.refund.query",
            {"trade_no": payment_id, "out_request_no": request_no},
        )
        if value.get("code") != SUCCESS_CODE or value.get("refund_status") != "REFUND_SUCCESS":
            return None
        try:
            return yuan_to_fen(str(value.get("refund_amount", "")))
        except ValueError:
            raise ProviderUnavailable("alipay refund query: refund_amount is not yuan") from None

    async def _refund_status(self, payment_id: str, request_no: str) -> str:
        value = await self._call(
            "alipay.trade.fastpay.refund.query",
            {"trade_no": payment_id, "out_request_no": request_no},
        )
        if value.get("code") != SUCCESS_CODE:
            return "pending"
        return "succeeded" if value.get("refund_status") == "REFUND_SUCCESS" else "pending"

    async def transactions(
        self, cursor: str | None, limit: int, since: int | None = None
    ) -> TransactionPage:
        """Alipay lists nothing per API call: the orders of the window (the gate's own
        sessions with this provider, from `window`) are queried one by one."""
        if self.window is None:
            return TransactionPage(items=[], next_cursor=None)
        orders, next_cursor = await self.window.orders(NAME, since or 0, cursor, limit)
        items: list[Transaction] = []
        for order_id in orders:
            trade = await self._query({"out_trade_no": order_id})
            payment = _payment(trade) if trade is not None else None
            if payment is None or trade is None:
                continue
            items.append(
                Transaction(
                    kind="payment",
                    id=payment.payment_id,
                    payment_id=payment.payment_id,
                    order_id=order_id,
                    amount=payment.amount,
                    currency=CURRENCY,
                    status=payment.status,
                    created=_seconds(trade.get("send_pay_date")) or int(time.time()),
                )
            )
        items.sort(key=lambda t: t.created)
        return TransactionPage(items=items, next_cursor=next_cursor)


class AlipayWebhook:
    """The notification endpoint's side: verify and read (parse), then answer the
    plain text `success` once the event is recorded (anything else: Alipay retries)."""

    header_names: tuple[str, ...] = ()

    def __init__(self, alipay: AlipaySettings, provider: AlipayProvider | None = None) -> None:
        self.alipay = alipay
        self.provider = provider

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent:
        return parse_notification(self.alipay, body, now)

    async def complete(self, event: ProviderEvent) -> ProviderEvent:
        """A refund notification's own amount. Its refund_fee is the trade's refunded
        total so far (Alipay's documentation of the asynchronous notification), so
        with two partial refunds of 30 and 20 the second says 50: the amount of the
        refund named by out_biz_no is asked of Alipay's refund query. A refund Alipay
        does not know as settled is recorded without an amount (quarantined as a
        mismatch); no answer raises ProviderUnavailable (503: Alipay retries)."""
        if event.type != "refund.succeeded" or event.order_id is None or self.provider is None:
            return event
        assert event.payment_id is not None and event.refund_id is not None
        own = await self.provider.refund_amount(event.payment_id, event.refund_id)
        if own is not None and event.amount is not None and own > event.amount:
            own = None  # more than the trade's refunded total: not a fact to apply
        return replace(event, amount=own)

    def acknowledge(self, outcome: str) -> Encoded:
        return encode_answer(200, b"text/plain; charset=utf-8", ACK_BODY)


def _seconds(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        return int(datetime.strptime(text, TIME_FORMAT).replace(tzinfo=CST).timestamp())
    except ValueError:
        return None


def _payment(trade: dict[str, Any]) -> Payment | None:
    raw_trade_no = trade.get("trade_no")
    if not raw_trade_no:
        return None  # no trade yet
    trade_no = answer_id(raw_trade_no, TRADE_NO_RE, "trade_no")
    status = trade.get("trade_status")
    if status in PAID:
        state = "succeeded"
    elif status == "TRADE_CLOSED":
        # Closed after paying means refunded in full; closed unpaid is a failure.
        state = "succeeded" if trade.get("send_pay_date") else "failed"
    else:
        return None  # WAIT_BUYER_PAY: nothing has happened yet
    try:
        amount = yuan_to_fen(str(trade.get("total_amount", "")))
    except ValueError:
        return None
    return Payment(
        payment_id=trade_no,
        order_id=order_id_or_none(trade.get("out_trade_no")),
        amount=amount,
        currency=CURRENCY,
        status=state,
    )


def parse_notification(alipay: AlipaySettings, body: bytes, now: float) -> ProviderEvent:
    """Verify an asynchronous notification and read it as a gate event.

    WebhookRejected (401, nothing recorded): not form-encoded UTF-8, a repeated
    parameter, no or a bad signature, or a notify_time more than 300 s from now.
    EventInvalid (400): genuine but not a trade notification the gate can read.
    Another app's genuine notification is returned without an order id (quarantined).
    """
    try:
        pairs = parse_qsl(
            body.decode("utf-8"),
            keep_blank_values=True,
            strict_parsing=True,
            max_num_fields=NOTIFY_PARAMS_MAX,
        )
    except (UnicodeDecodeError, ValueError):
        raise WebhookRejected("not a form-encoded UTF-8 notification") from None
    params = dict(pairs)
    if len(params) != len(pairs):
        raise WebhookRejected("a parameter is repeated")
    if params.get("sign_type", "RSA2") != "RSA2":
        raise WebhookRejected("only RSA2 notifications are accepted")
    if not verify_notification_params(alipay.alipay_public_key, params):
        raise WebhookRejected("the signature does not verify with Alipay's public key")
    sent = _seconds(params.get("notify_time"))
    if sent is None or abs(now - sent) > TOLERANCE_SECONDS:
        raise WebhookRejected("notify_time is missing or more than 300 s from now")
    event = notification_event(params, body)
    if params.get("app_id") != alipay.app_id:
        # Genuine (Alipay signed it) but for another app: it names no order of this
        # gate. Recorded and quarantined as an unknown order, payload kept.
        return replace(event, order_id=None)
    return event


def notification_event(params: Mapping[str, str], body: bytes) -> ProviderEvent:
    trade_no = event_id_of(params.get("trade_no"), TRADE_NO_RE, "trade_no")
    status = event_id_of(params.get("trade_status"), TRADE_STATUS_RE, "trade_status")
    order_id = order_id_or_none(params.get("out_trade_no"))
    refund_no = params.get("out_biz_no", "")
    is_refund = bool(refund_no or params.get("gmt_refund") or params.get("refund_fee"))
    created = _seconds(params.get("gmt_refund" if is_refund else "gmt_payment"))
    if is_refund:
        refund_no = event_id_of(refund_no, REQUEST_NO_RE, "out_biz_no")
        try:
            # The trade's refunded total so far; AlipayWebhook.complete replaces it
            # with this refund's own amount before the event is recorded.
            amount = yuan_to_fen(params.get("refund_fee", ""))
        except ValueError:
            raise EventInvalid("refund_fee is not a yuan amount") from None
        event_type, refund_id = "refund.succeeded", refund_no
        # One fact, one id: Alipay's retries (and a notification for the same refund)
        # are duplicates of this one.
        event_id = f"{NAME}:{trade_no}:refund:{refund_no}"
    else:
        try:
            amount = yuan_to_fen(params.get("total_amount", ""))
        except ValueError:
            raise EventInvalid("total_amount is not a yuan amount") from None
        refund_id = None
        if status in PAID:
            event_type = "payment.succeeded"
        elif status == "TRADE_CLOSED":
            event_type = "payment.failed"
        else:
            event_type = f"alipay.{status.lower()}"[:64]  # recorded and ignored
        event_id = f"{NAME}:{trade_no}:{event_type}"
    return ProviderEvent(
        event_id=event_id[:ID_MAX],
        type=event_type,
        created=created,
        order_id=order_id,
        payment_id=trade_no,
        amount=amount,
        currency=CURRENCY,
        refund_id=refund_id,
        payload=body,
    )


def build(context: AdapterContext) -> Adapter:
    """GATE_PAYMENT_PROVIDER=alipay: settings checked (SettingsError naming the
    variable), key files read; no network."""
    alipay = load_alipay_settings(context.env)
    provider = AlipayProvider(context.payment, alipay)
    return Adapter(
        name=context.name,
        webhook=AlipayWebhook(alipay, provider),
        provider=provider,
    )
