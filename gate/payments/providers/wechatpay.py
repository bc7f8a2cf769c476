"""WeChat Pay API v3 as a gate payment provider.

    session ──POST /v3/pay/transactions/native (out_trade_no = order id, time_expire =
        hold end, amount.total in fen)──> code_url (the QR code the buyer scans)
    buyer pays ──> WeChat ──POST notify_url JSON, Wechatpay-Signature──> gate
        verify (RSA-SHA256 over "timestamp\\nnonce\\nbody\\n" with the platform public
        key, timestamp within ±300 s) ──> decrypt resource (AEAD_AES_256_GCM, APIv3
        key, nonce, associated_data) ──> ProviderEvent ──> recorded ──> 204
    refund ──POST /v3/refund/domestic/refunds (out_refund_no = the gate's refund key)
    reconcile ──GET /v3/pay/transactions/out-trade-no/{order} per order of the window

Every request carries `Authorization: WECHATPAY2-SHA256-RSA2048 mchid="…",
nonce_str="…",signature="…",timestamp="…",serial_no="…"`, the signature over
"METHOD\\nPATH?QUERY\\ntimestamp\\nnonce\\nbody\\n" with the merchant key; every
answer's Wechatpay-Signature is verified the same way as a notification before it
is used.

Events: TRANSACTION.SUCCESS -> payment.succeeded (payment id = transaction_id);
REFUND.SUCCESS -> refund.succeeded (refund id = out_refund_no, the gate's key);
REFUND.ABNORMAL / REFUND.CLOSED -> refund.failed. WeChat sends no notification for
a failed or closed payment: the gate learns those from the query (trade_state
CLOSED / PAYERROR / REVOKED -> payment.failed). The basic Native/JSAPI API has no
authorize-then-capture: a manual-capture session is refused (422).
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote, urlsplit

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gate.base.errors import Encoded
from gate.base.settings import Secret, SettingsError
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
    certificate_serial,
    provider_key,
    read_private_key,
    read_public_key,
    sign_sha256_rsa,
    verify_sha256_rsa,
)
from gate.payments.signing import WebhookRejected
from gate.payments.window import OrderWindow

NAME = "wechatpay"
API_BASE = "https://api.mch.weixin.qq.com"
CURRENCY = "CNY"
TOLERANCE_SECONDS = 300
AUTH_SCHEMA = "WECHATPAY2-SHA256-RSA2048"
HEADERS = ("wechatpay-timestamp", "wechatpay-nonce", "wechatpay-signature", "wechatpay-serial")
NONCE_MAX = 64
CST = timezone(timedelta(hours=8))
FAILED_STATES = ("CLOSED", "PAYERROR", "REVOKED")
PAID_STATES = ("SUCCESS", "REFUND")
# WeChat Pay's documented formats: transaction_id string(32) of digits,
# out_refund_no string(64) of [0-9A-Za-z_-|*@], event types such as
# TRANSACTION.SUCCESS / REFUND.ABNORMAL.
TRANSACTION_ID_RE = re.compile(r"[0-9]{1,32}")
REFUND_NO_RE = re.compile(r"[0-9A-Za-z_\-|*@]{1,64}")
EVENT_TYPE_RE = re.compile(r"[A-Z0-9_.]{1,40}")
# Wechatpay-Serial names the key that signed: a platform certificate's serial
# number (hex) or, in WeChat's public-key mode, the key's id (PUB_KEY_ID_<digits>).
SERIAL_RE = re.compile(r"[0-9A-Fa-f]{1,64}|PUB_KEY_ID_[0-9A-Za-z]{1,64}")
PLATFORM_KEYS_MAX = 16


def key_id(serial: str) -> str:
    """The form ids are compared in: upper case, and a hex serial without leading
    zeros (a certificate's serial is a number; its text may or may not be padded)."""
    upper = serial.upper()
    return upper if upper.startswith("PUB_KEY_ID_") else upper.lstrip("0") or "0"


@dataclass(frozen=True)
class PlatformKeys:
    """WeChat Pay's verification keys by the id its Wechatpay-Serial header carries.
    Several at once, so that a rotation (WeChat signs with a new certificate or moves
    to public-key mode, and announces the new serial ahead) verifies both the old and
    the new key's notifications. `anonymous`: a bare public key configured without an
    id, used for any serial not configured (the single-key setting of old)."""

    by_id: Mapping[str, rsa.RSAPublicKey]
    anonymous: rsa.RSAPublicKey | None = None

    def select(self, serial: str) -> rsa.RSAPublicKey:
        if not SERIAL_RE.fullmatch(serial):
            raise WebhookRejected("Wechatpay-Serial missing or malformed")
        key = self.by_id.get(key_id(serial), self.anonymous)
        if key is None:
            raise WebhookRejected("Wechatpay-Serial names no configured platform key")
        return key

    def __repr__(self) -> str:
        return f"PlatformKeys(ids={sorted(self.by_id)!r}, anonymous={self.anonymous is not None})"


@dataclass(frozen=True)
class WechatPaySettings:
    mchid: str
    appid: str
    apiv3_key: Secret
    private_key: rsa.RSAPrivateKey
    cert_serial: str
    platform_keys: PlatformKeys
    api_base: str = API_BASE

    def __repr__(self) -> str:
        return f"WechatPaySettings(mchid={self.mchid!r}, appid={self.appid!r})"


def load_wechatpay_settings(env: Mapping[str, str]) -> WechatPaySettings:
    """Every required variable present and valid, or SettingsError naming it."""
    names = (
        "GATE_WECHATPAY_MCHID",
        "GATE_WECHATPAY_APPID",
        "GATE_WECHATPAY_APIV3_KEY",
        "GATE_WECHATPAY_PRIVATE_KEY_FILE",
        "GATE_WECHATPAY_CERT_SERIAL",
    )
    values = {}
    for name in names:
        raw = env.get(name, "").strip()
        if not raw:
            raise SettingsError(f"{name} is required with GATE_PAYMENT_PROVIDER=wechatpay")
        values[name] = raw
    if not values["GATE_WECHATPAY_MCHID"].isdigit() or len(values["GATE_WECHATPAY_MCHID"]) > 32:
        raise SettingsError("GATE_WECHATPAY_MCHID must be the numeric merchant id")
    if not values["GATE_WECHATPAY_APPID"].isalnum() or len(values["GATE_WECHATPAY_APPID"]) > 32:
        raise SettingsError("GATE_WECHATPAY_APPID must be the app id (letters and digits)")
    apiv3 = values["GATE_WECHATPAY_APIV3_KEY"]
    if len(apiv3.encode()) != 32 or not apiv3.isascii():
        raise SettingsError("GATE_WECHATPAY_APIV3_KEY must be the 32-character APIv3 key")
    serial = values["GATE_WECHATPAY_CERT_SERIAL"]
    if not serial.isalnum() or len(serial) > 64:
        raise SettingsError("GATE_WECHATPAY_CERT_SERIAL must be the merchant certificate serial")
    base = env.get("GATE_WECHATPAY_API_BASE", "").strip().rstrip("/") or API_BASE
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"GATE_WECHATPAY_API_BASE must be an http(s) URL, got {base!r}")
    dev = env.get("GATE_ENV", "production").strip().lower() == "dev"
    if parts.scheme != "https" and not dev and not is_loopback_host(parts.hostname):
        raise SettingsError(
            "GATE_WECHATPAY_API_BASE must be https:// outside GATE_ENV=dev"
            " (plain http only to a loopback address)"
        )
    return WechatPaySettings(
        mchid=values["GATE_WECHATPAY_MCHID"],
        appid=values["GATE_WECHATPAY_APPID"],
        apiv3_key=Secret(apiv3),
        private_key=read_private_key(
            "GATE_WECHATPAY_PRIVATE_KEY_FILE", values["GATE_WECHATPAY_PRIVATE_KEY_FILE"]
        ),
        cert_serial=serial,
        platform_keys=load_platform_keys(env),
        api_base=base,
    )


def _key_id(name: str, raw: str) -> str:
    if not SERIAL_RE.fullmatch(raw):
        raise SettingsError(
            f"{name}: {raw[:80]!r} is not a platform certificate serial (hex) or a"
            " public key id (PUB_KEY_ID_…)"
        )
    return key_id(raw)


def _platform_key(
    name: str, path: str, given_id: str | None
) -> tuple[str | None, rsa.RSAPublicKey]:
    """(id, key) of one file: the id given, else a certificate's serial, else None."""
    key = read_public_key(name, path)
    if given_id:
        return _key_id(name, given_id), key
    serial = certificate_serial(name, path)
    return (key_id(serial) if serial is not None else None), key


def load_platform_keys(env: Mapping[str, str]) -> PlatformKeys:
    """GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE (one file, its id from
    GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_ID or its certificate) and
    GATE_WECHATPAY_PLATFORM_KEY_FILES (a comma-separated list of `ID=path` or of
    certificate paths): at least one key, no id twice."""
    found: list[tuple[str, str | None, rsa.RSAPublicKey]] = []
    single = env.get("GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE", "").strip()
    if single:
        name = "GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE"
        given = env.get("GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_ID", "").strip() or None
        found.append((name, *_platform_key(name, single, given)))
    listed = [e.strip() for e in env.get("GATE_WECHATPAY_PLATFORM_KEY_FILES", "").split(",")]
    listed = [e for e in listed if e]
    if len(listed) > PLATFORM_KEYS_MAX:
        raise SettingsError(f"GATE_WECHATPAY_PLATFORM_KEY_FILES: at most {PLATFORM_KEYS_MAX} keys")
    for entry in listed:
        name = "GATE_WECHATPAY_PLATFORM_KEY_FILES"
        given, sep, path = entry.partition("=")
        if not sep:
            given, path = "", entry
        key_id, key = _platform_key(name, path.strip(), given.strip() or None)
        if key_id is None:
            raise SettingsError(
                f"{name}: {entry[:120]!r} is a bare public key: write it as"
                " PUB_KEY_ID_…=path (its id in WeChat Pay's console)"
            )
        found.append((name, key_id, key))
    if not found:
        raise SettingsError(
            "GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE or GATE_WECHATPAY_PLATFORM_KEY_FILES is"
            " required with GATE_PAYMENT_PROVIDER=wechatpay"
        )
    by_id: dict[str, rsa.RSAPublicKey] = {}
    anonymous = None
    for name, key_id, key in found:
        if key_id is None:
            anonymous = key
        elif key_id in by_id:
            raise SettingsError(f"{name}: the platform key id {key_id} is configured twice")
        else:
            by_id[key_id] = key
    return PlatformKeys(by_id=by_id, anonymous=anonymous)


# -- signatures -----------------------------------------------------------------------


def request_message(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """The signed content of a request: method, the URL's path and query, timestamp,
    nonce and body, each followed by a newline (an empty body is an empty line)."""
    return f"{method}\n{path}\n{timestamp}\n{nonce}\n".encode() + body + b"\n"


def authorization(
    key: rsa.RSAPrivateKey,
    mchid: str,
    serial: str,
    method: str,
    path: str,
    body: bytes,
    timestamp: str | None = None,
    nonce: str | None = None,
) -> str:
    ts = timestamp or str(int(time.time()))
    nonce_str = nonce or secrets.token_hex(16).upper()
    signature = sign_sha256_rsa(key, request_message(method, path, ts, nonce_str, body))
    return (
        f'{AUTH_SCHEMA} mchid="{mchid}",nonce_str="{nonce_str}",signature="{signature}",'
        f'timestamp="{ts}",serial_no="{serial}"'
    )


def parse_authorization(header: str) -> dict[str, str]:
    """The fields of an Authorization header (used by the test fake; quotes optional)."""
    if not header.startswith(AUTH_SCHEMA + " "):
        raise ValueError("not a WECHATPAY2-SHA256-RSA2048 header")
    fields: dict[str, str] = {}
    for part in header[len(AUTH_SCHEMA) + 1 :].split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise ValueError("malformed field")
        fields[name] = value.strip('"')
    return fields


def answer_message(timestamp: str, nonce: str, body: bytes) -> bytes:
    """The signed content of an answer or a notification."""
    return f"{timestamp}\n{nonce}\n".encode() + body + b"\n"


def verify_signed(keys: PlatformKeys, headers: Mapping[str, str], body: bytes, now: float) -> None:
    """Wechatpay-Timestamp/-Nonce/-Signature on an answer or a notification; raises
    WebhookRejected (fresh within ±300 s, signed by the platform key that
    Wechatpay-Serial names). Every header is checked as text of its own alphabet, so
    a byte outside it (non-ASCII included) is a rejection, never an error."""
    key = keys.select(headers.get("wechatpay-serial", ""))
    ts = headers.get("wechatpay-timestamp", "")
    nonce = headers.get("wechatpay-nonce", "")
    signature = headers.get("wechatpay-signature", "")
    # isascii: str.isdigit() also accepts digits int() cannot read (such as "²").
    if not (ts.isascii() and ts.isdigit()) or len(ts) > 12 or not nonce or len(nonce) > NONCE_MAX:
        raise WebhookRejected("Wechatpay-Timestamp/-Nonce missing or malformed")
    if not nonce.isascii() or not nonce.isprintable():
        raise WebhookRejected("Wechatpay-Nonce must be printable ASCII")
    if abs(now - int(ts)) > TOLERANCE_SECONDS:
        raise WebhookRejected("Wechatpay-Timestamp is more than 300 s from now")
    if not verify_sha256_rsa(key, answer_message(ts, nonce, body), signature):
        raise WebhookRejected("Wechatpay-Signature does not verify with the named platform key")


def decrypt_resource(apiv3_key: Secret, resource: Mapping[str, Any]) -> bytes:
    """AEAD_AES_256_GCM: key = the APIv3 key's 32 bytes, the resource's nonce and
    associated_data, ciphertext = base64(encrypted || 16-byte tag)."""
    if resource.get("algorithm") != "AEAD_AES_256_GCM":
        raise EventInvalid("resource.algorithm must be AEAD_AES_256_GCM")
    nonce = resource.get("nonce")
    ciphertext = resource.get("ciphertext")
    associated = resource.get("associated_data") or ""
    if (
        not isinstance(nonce, str)
        or not isinstance(ciphertext, str)
        or not isinstance(associated, str)
    ):
        raise EventInvalid("resource needs nonce, ciphertext and associated_data strings")
    try:
        data = base64.b64decode(ciphertext, validate=True)
        return AESGCM(apiv3_key.reveal().encode()).decrypt(
            nonce.encode(), data, associated.encode() or None
        )
    except (binascii.Error, ValueError, InvalidTag):
        # Signed by WeChat but not decryptable with our key: another merchant's
        # notification or a changed APIv3 key. Nothing we could record.
        raise WebhookRejected("resource does not decrypt with the APIv3 key") from None


def encrypt_resource(apiv3_key: str, plaintext: bytes, nonce: str, associated: str) -> str:
    """The inverse, for the test fake."""
    return base64.b64encode(
        AESGCM(apiv3_key.encode()).encrypt(nonce.encode(), plaintext, associated.encode() or None)
    ).decode()


# -- the provider ---------------------------------------------------------------------


def _rfc3339(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, CST).isoformat(timespec="seconds")


def _seconds(text: Any) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        return int(datetime.fromisoformat(text).timestamp())
    except ValueError:
        return None


def _fen(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not an amount in fen: {value!r}")
    return value


class WechatPayProvider:
    """The Provider interface (gate/payments/provider.py) over WeChat Pay API v3."""

    name = NAME

    def __init__(
        self,
        settings: PaymentSettings,
        wechat: WechatPaySettings,
        window: OrderWindow | None = None,
    ) -> None:
        self.settings = settings
        self.wechat = wechat
        self.window = window
        self.http = ProviderHttp(settings, NAME)

    async def close(self) -> None:
        await self.http.close()

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        """(status, verified JSON answer); a 204 is ({}); 404 is returned; other 4xx
        raise ProviderRejected with WeChat's `code`."""
        raw_body = orjson.dumps(body) if body is not None else b""

        def headers() -> dict[str, str]:
            h = {
                "Accept": "application/json",
                "Authorization": authorization(
                    self.wechat.private_key,
                    self.wechat.mchid,
                    self.wechat.cert_serial,
                    method,
                    path,
                    raw_body,
                ),
            }
            if body is not None:
                h["Content-Type"] = "application/json"
            return h

        answer = await self.http.request(
            method,
            self.wechat.api_base + path,
            raw_body if body is not None else None,
            headers,
            what=f"{method} {path}",
        )
        status = answer.status
        try:
            verify_signed(self.wechat.platform_keys, answer.headers, answer.raw, time.time())
        except WebhookRejected as exc:
            raise ProviderUnavailable(f"wechatpay {method} {path}: answer {exc}") from None
        if status == 204:
            return status, {}
        doc = self.http.json_object(answer, f"{method} {path}")
        if status >= 400 and status != 404:
            raise ProviderRejected(
                status, str(doc.get("code", "error"))[:64], str(doc.get("message", ""))[:255], doc
            )
        return status, doc

    async def create_session(self, request: SessionRequest, key: str) -> Session:
        if request.capture_mode != "automatic":
            raise ProviderRejected(
                422,
                "capture_unsupported",
                "WeChat Pay's Native/JSAPI API has no authorize-then-capture",
            )
        if request.currency != CURRENCY:
            raise ProviderRejected(422, "currency_unsupported", "WeChat Pay takes CNY only")
        notify = request.notify_url or self.settings.callback_url
        if notify is None:
            raise ProviderRejected(422, "notify_url_required", "GATE_PAYMENT_CALLBACK_URL is unset")
        # Native orders are idempotent by out_trade_no: the same request answers the
        # same code_url.
        _, doc = await self._call(
            "POST",
            "/v3/pay/transactions/native",
            {
                "appid": self.wechat.appid,
                "mchid": self.wechat.mchid,
                "description": request.description[:127] or request.order_id,
                "out_trade_no": request.order_id,
                "time_expire": _rfc3339(request.expires_at),
                "notify_url": notify,
                "amount": {"total": request.amount, "currency": CURRENCY},
            },
        )
        code_url = doc.get("code_url")
        if not isinstance(code_url, str):
            raise ProviderUnavailable("wechatpay native order: no code_url in the answer")
        return Session(
            session_id=request.order_id,
            order_id=request.order_id,
            redirect_url=code_url,
            expires_at=request.expires_at,
            status="open",
        )

    async def find_session(self, order_id: str) -> Session | None:
        return None  # create_session is idempotent by out_trade_no

    async def _query(self, order_id: str) -> dict[str, Any] | None:
        status, doc = await self._call(
            "GET",
            f"/v3/pay/transactions/out-trade-no/{quote(order_id, safe='')}"
            f"?mchid={quote(self.wechat.mchid, safe='')}",
        )
        return doc if status == 200 else None

    def _payment(self, doc: dict[str, Any]) -> Payment | None:
        state = doc.get("trade_state")
        order_id = order_id_or_none(doc.get("out_trade_no"))
        if order_id is None:
            return None
        if state in PAID_STATES:
            status = "succeeded"
        elif state in FAILED_STATES:
            status = "failed"
        else:
            return None  # NOTPAY / USERPAYING: nothing yet
        tx = doc.get("transaction_id")
        # Present, it must be one WeChat issues (else the answer is a failed call).
        payment_id = answer_id(tx, TRANSACTION_ID_RE, "transaction_id") if tx else None
        if payment_id is None:
            if status != "failed":
                return None
            payment_id = f"order:{order_id}"  # a closed trade that never had a transaction
        amount = doc.get("amount") or {}
        try:
            total = _fen(amount.get("total"))
        except (ValueError, AttributeError):
            return None
        return Payment(
            payment_id=payment_id,
            order_id=order_id,
            amount=total,
            currency=str(amount.get("currency") or CURRENCY),
            status=status,
        )

    async def payments_for_order(self, order_id: str) -> list[Payment]:
        doc = await self._query(order_id)
        payment = self._payment(doc) if doc is not None else None
        return [payment] if payment is not None else []

    async def get_payment(self, payment_id: str) -> Payment | None:
        if payment_id.startswith("order:"):
            found = await self.payments_for_order(payment_id[len("order:") :])
            return found[0] if found else None
        status, doc = await self._call(
            "GET",
            f"/v3/pay/transactions/id/{quote(payment_id, safe='')}"
            f"?mchid={quote(self.wechat.mchid, safe='')}",
        )
        return self._payment(doc) if status == 200 else None

    async def capture(self, payment_id: str, amount: int, key: str) -> Payment:
        raise ProviderRejected(422, "capture_unsupported", "WeChat Pay captures at payment")

    async def void(self, payment_id: str, key: str) -> Payment:
        raise ProviderRejected(422, "void_unsupported", "WeChat Pay has no authorization")

    async def refund(self, payment_id: str, amount: int, key: str) -> Refund:
        refund_no = provider_key(key)
        body: dict[str, Any] = {
            "transaction_id": payment_id,
            "out_refund_no": refund_no,
            "amount": {"refund": amount, "total": amount, "currency": CURRENCY},
        }
        if self.settings.callback_url:
            body["notify_url"] = self.settings.callback_url
        status, doc = await self._call("POST", "/v3/refund/domestic/refunds", body)
        if status == 404:
            raise ProviderRejected(404, "ORDER_NOT_EXIST", f"payment {payment_id} not found")
        return self._refund(doc, payment_id, amount)

    def _refund(self, doc: dict[str, Any], payment_id: str, amount: int) -> Refund:
        state = doc.get("status") or doc.get("refund_status")
        status = {"SUCCESS": "succeeded", "CLOSED": "failed", "ABNORMAL": "failed"}.get(
            str(state), "pending"
        )
        return Refund(
            refund_id=answer_id(doc.get("out_refund_no"), REFUND_NO_RE, "out_refund_no"),
            payment_id=answer_id(
                doc.get("transaction_id") or payment_id, TRANSACTION_ID_RE, "transaction_id"
            ),
            order_id=order_id_or_none(doc.get("out_trade_no")),
            amount=int((doc.get("amount") or {}).get("refund", amount)),
            currency=CURRENCY,
            status=status,
        )

    async def transactions(
        self, cursor: str | None, limit: int, since: int | None = None
    ) -> TransactionPage:
        """No listing in the API (the bill download is a daily file): the orders of
        the window are queried one by one."""
        if self.window is None:
            return TransactionPage(items=[], next_cursor=None)
        orders, next_cursor = await self.window.orders(NAME, since or 0, cursor, limit)
        items: list[Transaction] = []
        for order_id in orders:
            doc = await self._query(order_id)
            payment = self._payment(doc) if doc is not None else None
            if payment is None or doc is None:
                continue
            items.append(
                Transaction(
                    kind="payment",
                    id=payment.payment_id,
                    payment_id=payment.payment_id,
                    order_id=order_id,
                    amount=payment.amount,
                    currency=payment.currency,
                    status=payment.status,
                    created=_seconds(doc.get("success_time")) or int(time.time()),
                )
            )
        items.sort(key=lambda t: t.created)
        return TransactionPage(items=items, next_cursor=next_cursor)


class WechatPayWebhook:
    """The notification endpoint's side: verify, decrypt and read (parse), then 204
    once the event is recorded (anything else: WeChat retries)."""

    header_names: tuple[str, ...] = HEADERS

    def __init__(self, wechat: WechatPaySettings) -> None:
        self.wechat = wechat

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent:
        return parse_notification(self.wechat, headers, body, now)

    def acknowledge(self, outcome: str) -> Encoded:
        return 204, [], b""


def parse_notification(
    wechat: WechatPaySettings, headers: Mapping[str, str], body: bytes, now: float
) -> ProviderEvent:
    """Verify a notification (headers with lower-case names) and read it as a gate
    event. WebhookRejected (401, nothing recorded): bad or stale signature, a
    resource that does not decrypt. EventInvalid (400): genuine but unreadable.
    Another merchant's or app's genuine notification is returned without an order id
    (recorded and quarantined as naming no order of this gate)."""
    verify_signed(wechat.platform_keys, headers, body, now)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise EventInvalid("the body is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("resource"), dict):
        raise EventInvalid("the body must be an object with a resource")
    event_type = event_id_of(doc.get("event_type"), EVENT_TYPE_RE, "event_type")
    plain = decrypt_resource(wechat.apiv3_key, doc["resource"])
    try:
        res = orjson.loads(plain)
    except orjson.JSONDecodeError:
        raise EventInvalid("the decrypted resource is not JSON") from None
    if not isinstance(res, dict):
        raise EventInvalid("the decrypted resource must be an object")
    event = resource_event(event_type, res, body)
    foreign_merchant = res.get("mchid", res.get("sp_mchid")) != wechat.mchid
    if foreign_merchant or ("appid" in res and res["appid"] != wechat.appid):
        # Genuine (signed, and encrypted with our APIv3 key) but for another merchant
        # or app: it names no order of this gate. Quarantined as an unknown order.
        return replace(event, order_id=None)
    return event


def resource_event(event_type: str, res: Mapping[str, Any], body: bytes) -> ProviderEvent:
    order_id = order_id_or_none(res.get("out_trade_no"))
    tx = event_id_of(res.get("transaction_id"), TRANSACTION_ID_RE, "resource.transaction_id")
    amount_doc = res.get("amount")
    if not isinstance(amount_doc, dict):
        raise EventInvalid("resource.amount is required")
    currency = amount_doc.get("currency") or CURRENCY
    if event_type == "TRANSACTION.SUCCESS":
        try:
            amount = _fen(amount_doc.get("total"))
        except ValueError:
            raise EventInvalid("resource.amount.total must be fen") from None
        return ProviderEvent(
            event_id=f"{NAME}:{tx}:payment.succeeded"[:ID_MAX],
            type="payment.succeeded",
            created=_seconds(res.get("success_time")),
            order_id=order_id,
            payment_id=tx,
            amount=amount,
            currency=str(currency) if isinstance(currency, str) else None,
            refund_id=None,
            payload=body,
        )
    if event_type.startswith("REFUND."):
        refund_no = event_id_of(res.get("out_refund_no"), REFUND_NO_RE, "resource.out_refund_no")
        try:
            amount = _fen(amount_doc.get("refund"))
        except ValueError:
            raise EventInvalid("resource.amount.refund must be fen") from None
        gate_type = "refund.succeeded" if event_type == "REFUND.SUCCESS" else "refund.failed"
        return ProviderEvent(
            event_id=f"{NAME}:{refund_no}:{gate_type}"[:ID_MAX],
            type=gate_type,
            created=_seconds(res.get("success_time")),
            order_id=order_id,
            payment_id=tx,
            amount=amount,
            currency=CURRENCY,
            refund_id=refund_no,
            payload=body,
        )
    # Another event type: recorded and ignored by the gate.
    return ProviderEvent(
        event_id=f"{NAME}:{tx}:{event_type}"[:ID_MAX],
        type=f"wechatpay.{event_type.lower()}"[:64],
        created=None,
        order_id=order_id,
        payment_id=tx,
        amount=None,
        currency=None,
        refund_id=None,
        payload=body,
    )


def build(context: AdapterContext) -> Adapter:
    """GATE_PAYMENT_PROVIDER=wechatpay: settings checked (SettingsError naming the
    variable), key files read; no network."""
    wechat = load_wechatpay_settings(context.env)
    # WeChat takes notify_url with every order and refund and has no default.
    if context.payment.callback_url is None:
        raise SettingsError(
            "GATE_PAYMENT_CALLBACK_URL is required with GATE_PAYMENT_PROVIDER=wechatpay"
        )
    return Adapter(
        name=context.name,
        webhook=WechatPayWebhook(wechat),
        provider=WechatPayProvider(context.payment, wechat),
    )
