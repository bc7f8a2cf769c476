"""The sandbox provider's state: sessions, payments, refunds and the events it sends,
in memory and bounded, with the delivery of signed events to the gate
(gate/payments/sandbox/server.py serves it over HTTP).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import random
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from starlette.responses import Response

from gate.base.backoff import Backoff
from gate.base.settings import SettingsError
from gate.payments.signing import sign_headers

log = logging.getLogger("gate.sandbox")


BODY_MAX_BYTES = 16_384


URL_MAX_CHARS = 2048


NOTIFY_ALLOW_DEFAULT = "127.0.0.0/8 ::1 localhost"


NOTIFY_ALLOW_ENTRIES_MAX = 64


_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,62})(\.[a-z0-9]([a-z0-9-]{0,62}))*")


# What a test mode may be told to wait, at most.
CONTROL_SECONDS_MAX = 3600.0


ID_RE_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-:.")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


def _error(status: int, code: str, detail: str, **extra: Any) -> Response:
    """An RFC 9457 problem; `code` and `detail` are what the gate's client reads."""
    doc = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "code": code,
        "detail": detail,
        **extra,
    }
    headers = {"WWW-Authenticate": 'Bearer realm="sandbox"'} if status == 401 else None
    return Response(
        orjson.dumps(doc),
        status_code=status,
        media_type="application/problem+json",
        headers=headers,
    )


class BadRequest(Exception):
    def __init__(self, status: int, code: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.response = _error(status, code, detail, **extra)


@dataclass(frozen=True)
class NotifyAllow:
    """Where the sandbox may send callbacks: host names (exact) and IP networks.
    Names are compared as written, never resolved here."""

    names: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def parse(cls, name: str, raw: str) -> NotifyAllow:
        entries = raw.replace(",", " ").split()
        if len(entries) > NOTIFY_ALLOW_ENTRIES_MAX:
            raise SettingsError(f"{name} has more than {NOTIFY_ALLOW_ENTRIES_MAX} entries")
        names: set[str] = set()
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            host = entry.lower().rstrip(".")
            if len(host) > 253 or not _HOST_NAME.fullmatch(host) or host.replace(".", "").isdigit():
                raise SettingsError(f"{name}: {entry!r} is neither a host name nor an IP network")
            names.add(host)
        return cls(frozenset(names), tuple(networks))

    def allows(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host or parts.username is not None:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.rstrip(".") in self.names
        return any(address in net for net in self.networks if net.version == address.version)


@dataclass
class SandboxConfig:
    webhook_url: str
    public_url: str
    signing_keys: tuple[bytes, ...]
    api_key: str | None
    notify_allow: NotifyAllow = field(
        default_factory=lambda: NotifyAllow.parse("GATE_SANDBOX_NOTIFY_ALLOW", NOTIFY_ALLOW_DEFAULT)
    )
    retry_max: int = 12
    backoff_base_seconds: float = 0.5
    backoff_max_seconds: float = 60.0
    delivery_timeout_seconds: float = 10.0
    deliveries_max: int = 256
    objects_max: int = 1_000_000


@dataclass
class DeliveryControls:
    """What tests and demos may change at run time."""

    mode: str = "auto"  # auto: deliver as generated; hold: keep until /sandbox/deliver
    duplicates: int = 0  # extra copies of every event
    delay_seconds: float = 0.0
    reorder_window_seconds: float = 0.0  # each copy waits a random time within it
    drop_rate: float = 0.0  # probability that an event is never delivered
    refund_mode: str = "succeed"  # succeed | fail | pending
    session_delay_seconds: float = 0.0  # answer session creations this late
    webhook_url: str | None = None


@dataclass
class SbSession:
    id: str
    order_id: str
    amount: int
    currency: str
    capture_method: str
    expires_at: int
    notify_url: str | None
    return_url: str | None
    description: str
    url: str
    status: str = "open"
    created: int = field(default_factory=lambda: int(time.time()))
    # The W3C traceparent the creating call came with (the gate's client span), shown
    # as a test mode's request log would.
    traceparent: str | None = None


@dataclass
class SbPayment:
    id: str
    order_id: str
    session_id: str | None
    amount: int
    currency: str
    status: str  # authorized | succeeded | failed | voided
    captured_amount: int = 0
    refunded_amount: int = 0
    notify_url: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class SbRefund:
    id: str
    payment_id: str
    order_id: str
    amount: int
    currency: str
    status: str  # pending | succeeded | failed
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class SbEvent:
    id: str
    type: str
    order_id: str
    body: bytes
    url: str
    state: str = "pending"  # pending | held | delivered | failed | dropped
    attempts: int = 0
    last_status: int | None = None

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "order_id": self.order_id,
            "state": self.state,
            "attempts": self.attempts,
            "last_status": self.last_status,
            "body": orjson.loads(self.body),
        }


class Sandbox:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        # Between delivery attempts: base · 2^(n-1), at most the max, jittered.
        self._delivery_backoff = Backoff(
            min(config.backoff_base_seconds, config.backoff_max_seconds),
            config.backoff_max_seconds,
            jitter=0.5,
        )
        self.controls = DeliveryControls()
        self.sessions: dict[str, SbSession] = {}
        self.sessions_by_order: dict[str, list[str]] = {}
        self.payments: dict[str, SbPayment] = {}
        self.payments_by_order: dict[str, list[str]] = {}
        self.refunds: dict[str, SbRefund] = {}
        self.events: OrderedDict[str, SbEvent] = OrderedDict()
        # Payments and refunds in creation order, for the transaction listing.
        self.log: list[tuple[str, str]] = []
        self.idempotency: OrderedDict[tuple[str, str], tuple[str, int, dict[str, Any]]] = (
            OrderedDict()
        )
        self.stats = {"attempts": 0, "delivered": 0, "failed_attempts": 0, "dropped": 0}
        self._slots = asyncio.Semaphore(config.deliveries_max)
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    # -- plumbing -------------------------------------------------------------------

    def client(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.deliveries_max),
                timeout=aiohttp.ClientTimeout(total=self.config.delivery_timeout_seconds),
            )
        return self._client

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _room(self) -> None:
        if len(self.payments) + len(self.sessions) + len(self.refunds) >= self.config.objects_max:
            raise BadRequest(507, "sandbox_full", "The sandbox holds too many objects; restart it.")

    def _remember_event(self, event: SbEvent) -> None:
        self.events[event.id] = event
        while len(self.events) > self.config.objects_max:
            self.events.popitem(last=False)

    async def idempotent(
        self, kind: str, key: str | None, fingerprint: Mapping[str, Any], make: Any
    ) -> Response:
        """Run `make()` once per (kind, key); replay its answer for the same request."""
        if key is None or not 1 <= len(key) <= 255 or not set(key) <= ID_RE_CHARS:
            raise BadRequest(400, "idempotency_key_required", "Idempotency-Key header required.")
        fp = hashlib.sha256(orjson.dumps(fingerprint, option=orjson.OPT_SORT_KEYS)).hexdigest()
        async with self._lock:
            hit = self.idempotency.get((kind, key))
            if hit is not None:
                if hit[0] != fp:
                    raise BadRequest(
                        422, "idempotency_mismatch", "Idempotency-Key reused with another request."
                    )
                return _json(hit[2], hit[1])
            try:
                status, doc = make()
            except BadRequest as exc:
                # Refusals are remembered as well: the same key gets the same answer.
                body = orjson.loads(bytes(exc.response.body))
                self.idempotency[(kind, key)] = (fp, exc.response.status_code, body)
                raise
            self.idempotency[(kind, key)] = (fp, status, doc)
            while len(self.idempotency) > self.config.objects_max:
                self.idempotency.popitem(last=False)
            return _json(doc, status)

    # -- events ---------------------------------------------------------------------

    def emit(
        self,
        event_type: str,
        order_id: str,
        payment_id: str,
        amount: int,
        currency: str,
        notify_url: str | None,
        refund_id: str | None = None,
    ) -> SbEvent:
        data: dict[str, Any] = {
            "payment_id": payment_id,
            "order_id": order_id,
            "amount": amount,
            "currency": currency,
        }
        if refund_id is not None:
            data["refund_id"] = refund_id
        event_id = _id("evt")
        body = orjson.dumps(
            {"id": event_id, "type": event_type, "created": int(time.time()), "data": data}
        )
        url = notify_url or self.controls.webhook_url or self.config.webhook_url
        event = SbEvent(event_id, event_type, order_id, body, url)
        self._remember_event(event)
        c = self.controls
        if c.mode == "hold":
            event.state = "held"
        elif c.drop_rate > 0 and random.random() < c.drop_rate:
            event.state = "dropped"
            self.stats["dropped"] += 1
        else:
            for _ in range(1 + c.duplicates):
                wait = c.delay_seconds + random.uniform(0, c.reorder_window_seconds)
                self._spawn(self._deliver_with_retries(event, wait))
        return event

    async def _send(self, event: SbEvent) -> int:
        """One signed attempt; returns the HTTP status (0 when nothing answered)."""
        headers = sign_headers(self.config.signing_keys, event.id, int(time.time()), event.body)
        headers["Content-Type"] = "application/json"
        event.attempts += 1
        self.stats["attempts"] += 1
        try:
            # No redirects: a target on the allow-list must not bounce the callback
            # somewhere that is not.
            async with self.client().post(
                event.url, data=event.body, headers=headers, allow_redirects=False
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            status = 0
        event.last_status = status
        if 200 <= status < 300:
            event.state = "delivered"
            self.stats["delivered"] += 1
        else:
            self.stats["failed_attempts"] += 1
        return status

    async def _deliver_with_retries(self, event: SbEvent, wait: float) -> None:
        if wait > 0:
            await asyncio.sleep(wait)
        cfg = self.config
        for attempt in range(cfg.retry_max):
            async with self._slots:
                status = await self._send(event)
            if 200 <= status < 300:
                return
            await asyncio.sleep(self._delivery_backoff.delay_seconds(attempt + 1))
        if event.state != "delivered":
            event.state = "failed"
            log.warning("event %s: gave up after %d attempts", event.id, cfg.retry_max)

    # -- objects --------------------------------------------------------------------

    def session_view(self, s: SbSession) -> dict[str, Any]:
        return asdict(s)

    def payment_view(self, p: SbPayment) -> dict[str, Any]:
        doc = asdict(p)
        doc.pop("notify_url")
        return doc

    def new_payment(
        self,
        order_id: str,
        session_id: str | None,
        amount: int,
        currency: str,
        status: str,
        notify_url: str | None,
    ) -> SbPayment:
        self._room()
        p = SbPayment(
            _id("pi"),
            order_id,
            session_id,
            amount,
            currency,
            status,
            captured_amount=amount if status == "succeeded" else 0,
            notify_url=notify_url,
        )
        self.payments[p.id] = p
        self.payments_by_order.setdefault(order_id, []).append(p.id)
        self.log.append(("payment", p.id))
        return p

    def emit_payment(self, p: SbPayment) -> SbEvent:
        event_type = {
            "succeeded": "payment.succeeded",
            "authorized": "payment.authorized",
            "failed": "payment.failed",
            "voided": "authorization.voided",
        }[p.status]
        amount = p.captured_amount if p.status == "succeeded" else p.amount
        return self.emit(event_type, p.order_id, p.id, amount, p.currency, p.notify_url)

    def new_refund(self, p: SbPayment, amount: int, *, force: bool = False) -> SbRefund:
        self._room()
        committed = sum(
            r.amount
            for r in self.refunds.values()
            if r.payment_id == p.id and r.status in ("pending", "succeeded")
        )
        if p.status != "succeeded":
            raise BadRequest(409, "payment_not_captured", f"Payment is {p.status}.")
        if not force and committed + amount > p.captured_amount:
            raise BadRequest(
                409,
                "amount_exceeds_refundable",
                f"At most {p.captured_amount - committed} can still be refunded.",
            )
        r = SbRefund(_id("re"), p.id, p.order_id, amount, p.currency, "pending")
        self.refunds[r.id] = r
        self.log.append(("refund", r.id))
        mode = self.controls.refund_mode
        if mode in ("succeed", "fail"):
            self.settle_refund(r, mode)
        return r

    def created_of(self, entry: tuple[str, str]) -> int:
        kind, oid = entry
        return self.payments[oid].created if kind == "payment" else self.refunds[oid].created

    def settle_refund(self, r: SbRefund, outcome: str) -> None:
        if r.status != "pending":
            return
        p = self.payments[r.payment_id]
        r.status = "succeeded" if outcome == "succeed" else "failed"
        if r.status == "succeeded":
            p.refunded_amount += r.amount
        self.emit(f"refund.{r.status}", r.order_id, p.id, r.amount, r.currency, p.notify_url, r.id)
