"""Stripe: Checkout Sessions in, signed `payment_intent.*` / refund events back.

    create_session --POST /v1/checkout/sessions--> Stripe (mode=payment, the order id
        in metadata[order_id] of the session and of its PaymentIntent; manual capture:
        payment_intent_data[capture_method]=manual) --> the buyer pays on session.url
    Stripe --POST /v1/payments/stripe/webhook, Stripe-Signature: t=..,v1=..--> gate
        verified by the official library (stripe.WebhookSignature.verify_header,
        300 s tolerance, any of GATE_STRIPE_WEBHOOK_SECRET's secrets), then read:
          payment_intent.succeeded                -> payment.succeeded
          payment_intent.amount_capturable_updated -> payment.authorized
          payment_intent.payment_failed           -> payment.failed
          payment_intent.canceled                 -> authorization.voided
          charge.refunded / refund.updated        -> refund.succeeded | refund.failed
          anything else                           -> recorded as ignored
        an acted-on event whose api_version is not one the parsing reads the same as
        API_VERSION -> quarantine.api_version_mismatch (recorded, quarantined, never
        applied; reconciliation reads the fact from the API at API_VERSION)
    every API call sends Stripe-Version: API_VERSION (answers in the shape parsed here)
    capture / void / refund --POST, form-encoded, Idempotency-Key--> Stripe
    reconciliation: GET /v1/payment_intents and /v1/refunds, created[gte], paged

Why aiohttp and not the `stripe` library's client for the API calls: the library's
default HTTP client is synchronous (requests/urllib) and its async one needs httpx,
which the gate does not use (aiohttp is its client, with per-attempt timeouts and one
bounded connection pool). The calls are few and plain form posts; the library is used
where getting it wrong is dangerous: the signature check.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import orjson
import stripe

from gate.base.errors import Encoded
from gate.base.settings import Secret, SettingsError
from gate.payments.adapters import Adapter, AdapterContext, require
from gate.payments.config import is_loopback_host
from gate.payments.provider import (
    AMOUNT_MAX,
    CURRENCY_RE,
    ORDER_ID_RE,
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
    checked_id,
    event_id_of,
    order_id_or_none,
)
from gate.payments.providers.provider_http import ProviderHttp
from gate.payments.providers.sandbox import json_acknowledgements
from gate.payments.signing import WebhookRejected
from gate.web.http_io import json_answer

log = logging.getLogger("gate.payments.stripe")

NAME = "stripe"
# The Stripe API version the parsing in this module is written for (docs/payments.md,
# "API version"). Sent as Stripe-Version on every call, so answers come in this shape
# whatever the account's default version is; webhook endpoints are created with it.
API_VERSION = "2024-06-20"
# Versions whose events render every field read here (a PaymentIntent's id, status,
# amount, amount_received, amount_capturable, currency, metadata, latest_charge,
# last_payment_error; a refund's id, payment_intent, amount, currency, status,
# metadata; a charge's refunds list, absent or not) as API_VERSION does: Stripe's
# changelog from 2022-11-15 (PaymentIntent.charges replaced by latest_charge, a
# charge's refunds no longer included) to API_VERSION changes none of them. An event of
# any other version is quarantined, never read with a guess of its shape.
COMPATIBLE_API_VERSIONS = frozenset(
    {"2022-11-15", "2023-08-16", "2023-10-16", "2024-04-10", API_VERSION}
)
# The recorded type of such an event: the database quarantines a `quarantine.<reason>`
# type with <reason> as its detail (gate_payment_event_in_tx).
VERSION_QUARANTINE = "quarantine.api_version_mismatch"
API_BASE = "https://api.stripe.com"
TOLERANCE_SECONDS = 300
SIGNATURE_HEADER_MAX = 2048
SECRETS_MAX = 4
# Stripe's list endpoints return at most 100 objects a page.
PAGE_MAX = 100
# Stripe's object ids: a type prefix, an underscore, letters and digits (`evt_…`,
# `pi_…`, `re_…`, `cs_test_…`). Stripe promises at most 255 characters; the gate
# takes at most 128, which every id Stripe issues fits and which keeps its columns
# (191) and the ids built from them whole.
STRIPE_ID_RE = re.compile(r"[A-Za-z0-9_]{1,128}")

PAYMENT_EVENTS = {
    "payment_intent.succeeded": "payment.succeeded",
    "payment_intent.amount_capturable_updated": "payment.authorized",
    "payment_intent.payment_failed": "payment.failed",
    "payment_intent.canceled": "authorization.voided",
}
REFUND_EVENTS = ("charge.refunded", "refund.updated")


class StripeSettings:
    def __init__(self, env: Mapping[str, str], is_dev: bool) -> None:
        api_key = require(env, "GATE_STRIPE_API_KEY", NAME)
        if not api_key.startswith(("sk_", "rk_")) or len(api_key) > 255:
            raise SettingsError(
                "GATE_STRIPE_API_KEY must be a Stripe secret or restricted key (sk_… or rk_…)"
            )
        secrets = require(env, "GATE_STRIPE_WEBHOOK_SECRET", NAME).split()
        if len(secrets) > SECRETS_MAX or not all(
            s.startswith("whsec_") and 10 <= len(s) <= 255 for s in secrets
        ):
            raise SettingsError(
                "GATE_STRIPE_WEBHOOK_SECRET must be 1-4 space-separated whsec_… secrets"
                " (the endpoint's signing secrets from Stripe's dashboard)"
            )
        base = env.get("GATE_STRIPE_API_BASE", "").strip().rstrip("/") or API_BASE
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingsError(f"GATE_STRIPE_API_BASE must be an http(s) URL, got {base!r}")
        if parts.scheme != "https" and not is_dev and not is_loopback_host(parts.hostname):
            raise SettingsError(
                "GATE_STRIPE_API_BASE must be https:// outside GATE_ENV=dev"
                " (plain http only to a loopback address such as 127.0.0.1)"
            )
        self.api_key = Secret(api_key)
        self.webhook_secrets = tuple(Secret(s) for s in secrets)
        self.api_base = base


def _minor(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= AMOUNT_MAX:
        raise EventInvalid(f"{what} must be a non-negative integer (minor units)")
    return value


def _currency(value: Any) -> str | None:
    # Stripe writes currencies in lower case; the gate in ISO capitals. Anything else
    # cannot match an order: the event is quarantined.
    if isinstance(value, str) and CURRENCY_RE.fullmatch(value.upper()):
        return value.upper()
    return None


def _order_id(obj: Mapping[str, Any]) -> str | None:
    metadata = obj.get("metadata")
    raw = metadata.get("order_id") if isinstance(metadata, dict) else None
    return order_id_or_none(raw)


def _payment_status(pi: Mapping[str, Any]) -> str | None:
    """The gate's status of a PaymentIntent; None while it is still under way."""
    status = pi.get("status")
    if status == "succeeded":
        return "succeeded"
    if status == "requires_capture":
        return "authorized"
    if status == "canceled":
        # Cancelled with money held is a void; cancelled before paying, a failure.
        return "voided" if pi.get("amount_capturable") or pi.get("latest_charge") else "failed"
    if status == "requires_payment_method" and pi.get("last_payment_error"):
        return "failed"
    return None


def _payment(pi: Mapping[str, Any]) -> Payment | None:
    status = _payment_status(pi)
    if status is None:
        return None
    amount = pi.get("amount_received") if status == "succeeded" else pi.get("amount")
    payment_id = answer_id(pi.get("id"), STRIPE_ID_RE, "PaymentIntent id")
    return Payment(
        payment_id=payment_id,
        order_id=_order_id(pi),
        amount=int(amount or 0),
        currency=_currency(pi.get("currency")) or str(pi.get("currency", "")).upper(),
        status=status,
        refunded_amount=0,
    )


def _refund_status(status: Any) -> str:
    if status == "succeeded":
        return "succeeded"
    if status in ("failed", "canceled"):
        return "failed"
    return "pending"


def _refund(re_: Mapping[str, Any], order_id: str | None = None) -> Refund:
    return Refund(
        refund_id=answer_id(re_.get("id"), STRIPE_ID_RE, "refund id"),
        payment_id=answer_id(re_.get("payment_intent"), STRIPE_ID_RE, "PaymentIntent id"),
        order_id=_order_id(re_) or order_id,
        amount=int(re_["amount"]),
        currency=_currency(re_.get("currency")) or str(re_.get("currency", "")).upper(),
        status=_refund_status(re_.get("status")),
    )


class _Envelope:
    """What every event of one delivery shares: its id, time and raw body."""

    def __init__(self, event_id: str, created: int, payload: bytes) -> None:
        self.event_id = event_id
        self.created = created
        self.payload = payload

    def event(
        self,
        *,
        type: str,
        order_id: str | None,
        payment_id: str | None,
        amount: int | None,
        currency: str | None,
        refund_id: str | None,
    ) -> ProviderEvent:
        return ProviderEvent(
            event_id=self.event_id,
            type=type,
            created=self.created,
            order_id=order_id,
            payment_id=payment_id,
            amount=amount,
            currency=currency,
            refund_id=refund_id,
            payload=self.payload,
        )


class StripeWebhook:
    header_names: tuple[str, ...] = ("stripe-signature",)

    def __init__(self, secrets: tuple[Secret, ...]) -> None:
        self.secrets = secrets
        self._answers = json_acknowledgements()

    def _verify(self, header: str, body: bytes, now: float) -> None:
        if not header or len(header) > SIGNATURE_HEADER_MAX:
            raise WebhookRejected("missing or oversized Stripe-Signature")
        if not header.isascii():
            # The library compares signatures with hmac.compare_digest, which raises
            # TypeError on a str past ASCII (a header's bytes 0x80-0xff).
            raise WebhookRejected("Stripe-Signature must be ASCII")
        try:
            payload = body.decode("utf-8")
        except UnicodeDecodeError:
            raise WebhookRejected("the body is not UTF-8 (Stripe signs UTF-8 JSON)") from None
        for secret in self.secrets:
            try:
                stripe.WebhookSignature.verify_header(
                    payload, header, secret.reveal(), tolerance=TOLERANCE_SECONDS
                )
                break
            except stripe.SignatureVerificationError as exc:
                reason = str(exc.user_message or exc)
        else:
            raise WebhookRejected(f"Stripe-Signature: {reason}")
        # The library refuses a timestamp older than the tolerance but not one ahead
        # of the clock; the gate's window is ±300 s as for every provider.
        stamps = [v for k, _, v in (p.partition("=") for p in header.split(",")) if k == "t"]
        if not stamps or not stamps[0].isdigit() or int(stamps[0]) > now + TOLERANCE_SECONDS:
            raise WebhookRejected("Stripe-Signature timestamp outside the ±300 s window")

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent:
        self._verify(headers.get("stripe-signature", ""), body, now)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise EventInvalid("the body is not JSON") from None
        if not isinstance(doc, dict) or doc.get("object", "event") != "event":
            raise EventInvalid("the body is not a Stripe event")
        event_id, event_type, created = doc.get("id"), doc.get("type"), doc.get("created")
        data = doc.get("data")
        event_id = event_id_of(event_id, STRIPE_ID_RE, "the event id")
        if not isinstance(event_type, str) or not 1 <= len(event_type) <= 64:
            raise EventInvalid("type must be a string of 1-64 characters")
        if not event_type.isascii() or not event_type.isprintable():
            raise EventInvalid("type must be printable ASCII")
        if isinstance(created, bool) or not isinstance(created, int) or created < 0:
            raise EventInvalid("created must be unix seconds")
        obj = data.get("object") if isinstance(data, dict) else None
        if not isinstance(obj, dict):
            raise EventInvalid("data.object must be an object")
        base = _Envelope(event_id, created, body)
        version = doc.get("api_version")
        known = isinstance(version, str) and version in COMPATIBLE_API_VERSIONS
        if not known and (event_type in PAYMENT_EVENTS or event_type in REFUND_EVENTS):
            return self._version_quarantined(event_type, version, obj, base)
        if event_type in PAYMENT_EVENTS:
            return self._payment_event(event_type, obj, base)
        if event_type in REFUND_EVENTS:
            return self._refund_event(event_type, obj, base)
        # Verified, but nothing the gate acts on: recorded as ignored (type kept).
        return base.event(
            type=f"stripe.{event_type}"[:64],
            order_id=_order_id(obj),
            payment_id=None,
            amount=None,
            currency=None,
            refund_id=None,
        )

    def _version_quarantined(
        self, event_type: str, version: Any, obj: Mapping[str, Any], base: _Envelope
    ) -> ProviderEvent:
        """An event the gate acts on, rendered at a version whose shape is not known
        to match API_VERSION's: recorded and quarantined with the reason, its ids kept
        only where they read as ids (for the operator and the outbox)."""
        shown = version if isinstance(version, str) and version.isprintable() else None
        log.warning(
            "Stripe event %s (%s) has api_version %r; the adapter reads %s and versions"
            " known to match it: quarantined (set the webhook endpoint's API version)",
            base.event_id,
            event_type,
            shown[:40] if shown is not None else None,
            API_VERSION,
        )
        payment = obj.get("id") if event_type in PAYMENT_EVENTS else obj.get("payment_intent")
        return base.event(
            type=VERSION_QUARANTINE,
            order_id=_order_id(obj),
            payment_id=checked_id(payment, STRIPE_ID_RE),
            amount=None,
            currency=None,
            refund_id=None,
        )

    def _payment_event(
        self, event_type: str, pi: Mapping[str, Any], base: _Envelope
    ) -> ProviderEvent:
        payment_id = event_id_of(pi.get("id"), STRIPE_ID_RE, "data.object.id (PaymentIntent)")
        if event_type == "payment_intent.succeeded":
            amount = _minor(pi.get("amount_received", pi.get("amount")), "amount_received")
        elif event_type == "payment_intent.amount_capturable_updated":
            amount = _minor(pi.get("amount_capturable"), "amount_capturable")
        else:
            amount = _minor(pi.get("amount"), "amount")
        return base.event(
            type=PAYMENT_EVENTS[event_type],
            order_id=_order_id(pi),
            payment_id=payment_id,
            amount=amount,
            currency=_currency(pi.get("currency")),
            refund_id=None,
        )

    def _refund_event(
        self, event_type: str, obj: Mapping[str, Any], base: _Envelope
    ) -> ProviderEvent:
        if event_type == "charge.refunded":
            # The charge lists its refunds, newest first (when the API version embeds
            # them): the event is about the newest. Without the list there is nothing
            # to apply; refund.updated and reconciliation carry the fact.
            refunds = obj.get("refunds")
            items = refunds.get("data") if isinstance(refunds, dict) else None
            if not isinstance(items, list) or not items or not isinstance(items[0], dict):
                return base.event(
                    type="stripe.charge.refunded",
                    order_id=_order_id(obj),
                    payment_id=None,
                    amount=None,
                    currency=None,
                    refund_id=None,
                )
            refund = items[0]
            order_id = _order_id(refund) or _order_id(obj)
        else:
            refund = dict(obj)
            order_id = _order_id(refund)
        refund_id = event_id_of(refund.get("id"), STRIPE_ID_RE, "the refund id")
        payment_id = event_id_of(
            refund.get("payment_intent"), STRIPE_ID_RE, "the refund's PaymentIntent"
        )
        status = _refund_status(refund.get("status"))
        return base.event(
            # A refund still pending has no effect yet: recorded as ignored.
            type=f"refund.{status}" if status != "pending" else "stripe.refund.pending",
            order_id=order_id,
            payment_id=payment_id,
            amount=_minor(refund.get("amount"), "refund amount"),
            currency=_currency(refund.get("currency")),
            refund_id=refund_id,
        )

    def acknowledge(self, outcome: str) -> Encoded:
        # The header list is copied: the request middleware appends its X-Request-Id.
        status, headers, body = self._answers.get(outcome) or json_answer(
            {"received": True, "outcome": outcome}
        )
        return status, list(headers), body


def _form(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Stripe's form encoding: nested keys as a[b][c], lists as a[0][b]."""
    out: list[tuple[str, str]] = []
    for key, value in params.items():
        name = f"{prefix}[{key}]" if prefix else str(key)
        if value is None:
            continue
        if isinstance(value, dict):
            out.extend(_form(value, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    out.extend(_form(item, f"{name}[{i}]"))
                else:
                    out.append((f"{name}[{i}]", str(item)))
        elif isinstance(value, bool):
            out.append((name, "true" if value else "false"))
        else:
            out.append((name, str(value)))
    return out


class StripeProvider:
    """The gate's Provider on Stripe's API: bounded attempts, Idempotency-Key."""

    def __init__(self, name: str, config: StripeSettings, context: AdapterContext) -> None:
        self.name = name
        self.config = config
        self.settings = context.payment
        # Stripe: 409 is an idempotent request still being processed; 429 and 5xx
        # may pass. The same key makes the retry safe.
        self.http = ProviderHttp(self.settings, NAME, frozenset({409, 429}))
        self._headers = {
            "Authorization": f"Bearer {config.api_key.reveal()}",
            "Content-Type": "application/x-www-form-urlencoded",
            "Stripe-Version": API_VERSION,
        }

    async def close(self) -> None:
        await self.http.close()

    async def _call(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        key: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        headers = dict(self._headers)
        if key is not None:
            headers["Idempotency-Key"] = key
        encoded = urlencode(_form(params or {}))
        url = self.config.api_base + path
        data: str | None = None
        if method == "GET":
            url += ("&" if "?" in path else "?") + encoded if encoded else ""
        else:
            data = encoded
        answer = await self.http.request(method, url, data, headers, what=f"{method} {path}")
        doc = self.http.json_object(answer, f"{method} {path}")
        if answer.status >= 400:
            found = doc.get("error")
            error: dict[str, Any] = found if isinstance(found, dict) else {}
            code = str(error.get("code") or error.get("type") or "error")
            if answer.status == 404 and code == "resource_missing":
                return answer.status, doc
            raise ProviderRejected(answer.status, code, str(error.get("message", "")), doc)
        return answer.status, doc

    async def create_session(self, request: SessionRequest, key: str) -> Session:
        # No expires_at: Stripe refuses one sooner than 30 minutes from its clock, so
        # for a short hold it would have to be computed from "now", and a retry under
        # the same Idempotency-Key would then differ from the first request (a 400).
        # The page stays open Stripe's default 24 h; a payment after the hold is a
        # late payment (re-take or refund), as with any provider.
        metadata = {"order_id": request.order_id}
        params: dict[str, Any] = {
            "mode": "payment",
            "client_reference_id": request.order_id,
            "metadata": metadata,
            "line_items": [
                {
                    "quantity": 1,
                    "price_data": {
                        "currency": request.currency.lower(),
                        "unit_amount": request.amount,
                        "product_data": {"name": request.description[:250] or "order"},
                    },
                }
            ],
            "payment_intent_data": {
                "capture_method": request.capture_mode,
                "metadata": metadata,
            },
            "success_url": request.return_url or self.settings.return_url,
        }
        _, doc = await self._call("POST", "/v1/checkout/sessions", params, key)
        return Session(
            session_id=answer_id(doc.get("id"), STRIPE_ID_RE, "Checkout Session id"),
            order_id=_order_id(doc) or "",
            redirect_url=str(doc.get("url") or ""),
            expires_at=int(doc["expires_at"]) if doc.get("expires_at") else None,
            status=str(doc.get("status") or "open"),
        )

    async def find_session(self, order_id: str) -> Session | None:
        # Stripe cannot list Checkout Sessions by metadata; a creation whose answer was
        # lost is found again by retrying it with the same Idempotency-Key.
        return None

    async def _search(self, order_id: str) -> list[dict[str, Any]]:
        if not ORDER_ID_RE.fullmatch(order_id):
            return []
        query = quote(f"metadata['order_id']:'{order_id}'")
        _, doc = await self._call("GET", f"/v1/payment_intents/search?query={query}&limit=100")
        return [pi for pi in doc.get("data") or [] if isinstance(pi, dict)]

    async def payments_for_order(self, order_id: str) -> list[Payment]:
        found = [_payment(pi) for pi in await self._search(order_id)]
        return [p for p in found if p is not None]

    async def get_payment(self, payment_id: str) -> Payment | None:
        if not STRIPE_ID_RE.fullmatch(payment_id):
            return None
        status, doc = await self._call("GET", f"/v1/payment_intents/{quote(payment_id)}")
        return _payment(doc) if status == 200 else None

    async def _pi_action(self, payment_id: str, action: str, params: Any, key: str) -> Payment:
        status, doc = await self._call(
            "POST", f"/v1/payment_intents/{quote(payment_id, safe='')}/{action}", params, key
        )
        if status == 404:
            raise ProviderRejected(404, "resource_missing", f"PaymentIntent {payment_id}")
        payment = _payment(doc)
        if payment is None:
            raise ProviderUnavailable(f"PaymentIntent {payment_id} still {doc.get('status')}")
        return payment

    async def capture(self, payment_id: str, amount: int, key: str) -> Payment:
        return await self._pi_action(payment_id, "capture", {"amount_to_capture": amount}, key)

    async def void(self, payment_id: str, key: str) -> Payment:
        return await self._pi_action(payment_id, "cancel", {}, key)

    async def refund(self, payment_id: str, amount: int, key: str) -> Refund:
        # The order id travels in the refund's metadata, so that its events and the
        # refund listing name the order; it is read from the PaymentIntent.
        status, pi = await self._call("GET", f"/v1/payment_intents/{quote(payment_id, safe='')}")
        if status == 404:
            raise ProviderRejected(404, "resource_missing", f"PaymentIntent {payment_id}")
        order_id = _order_id(pi)
        params = {
            "payment_intent": payment_id,
            "amount": amount,
            "metadata": {"order_id": order_id} if order_id else None,
        }
        _, doc = await self._call("POST", "/v1/refunds", params, key)
        return _refund(doc, order_id)

    async def transactions(
        self, cursor: str | None, limit: int, since: int | None = None
    ) -> TransactionPage:
        """PaymentIntents, then Refunds, created since `since`. The cursor is
        `<pi|re>:<starting_after or empty>` (Stripe pages newest first by id)."""
        kind, _, after = (cursor or "pi:").partition(":")
        if kind not in ("pi", "re"):
            kind, after = "pi", ""
        params: dict[str, Any] = {"limit": max(1, min(limit, PAGE_MAX))}
        if since is not None:
            params["created"] = {"gte": int(since)}
        if after:
            params["starting_after"] = after
        path = "/v1/payment_intents" if kind == "pi" else "/v1/refunds"
        _, doc = await self._call("GET", path, params)
        rows = [o for o in doc.get("data") or [] if isinstance(o, dict)]
        items: list[Transaction] = []
        for obj in rows:
            if kind == "pi":
                payment = _payment(obj)
                if payment is None:
                    continue
                items.append(
                    Transaction(
                        kind="payment",
                        id=payment.payment_id,
                        payment_id=payment.payment_id,
                        order_id=payment.order_id,
                        amount=payment.amount,
                        currency=payment.currency,
                        status=payment.status,
                        created=int(obj.get("created") or 0),
                    )
                )
            else:
                refund = _refund(obj)
                items.append(
                    Transaction(
                        kind="refund",
                        id=refund.refund_id,
                        payment_id=refund.payment_id,
                        order_id=refund.order_id,
                        amount=refund.amount,
                        currency=refund.currency,
                        status=refund.status,
                        created=int(obj.get("created") or 0),
                    )
                )
        if doc.get("has_more") and rows:
            last = answer_id(rows[-1].get("id"), STRIPE_ID_RE, "object id")
            next_cursor: str | None = f"{kind}:{last}"
        elif kind == "pi":
            next_cursor = "re:"
        else:
            next_cursor = None
        return TransactionPage(items=items, next_cursor=next_cursor)


def build(context: AdapterContext) -> Adapter:
    config = StripeSettings(context.env, context.is_dev)
    return Adapter(
        name=context.name,
        webhook=StripeWebhook(config.webhook_secrets),
        provider=StripeProvider(context.name, config, context),
    )
