"""The sandbox payment provider: a separate HTTP service (`gate sandbox`), the way
payment platforms offer a test mode.

Provider API (what the gate calls; changing calls require `Idempotency-Key`):
  POST /v1/sessions                  {order_id, amount, currency, capture_method,
                                      expires_at, description?, notify_url?, return_url?}
  GET  /v1/sessions?order_id=        sessions of an order (query by order)
  GET  /v1/payments?order_id=        payments of an order
  GET  /v1/payments/{id}
  POST /v1/payments/{id}/capture     {amount?}
  POST /v1/payments/{id}/void
  POST /v1/refunds                   {payment_id, amount}
  GET  /v1/refunds/{id}
  GET  /v1/transactions?after=&limit=&created_gte=  payments and refunds in creation order
The buyer's step:
  GET  /pay/{session_id}             a small page with the three outcomes
  POST /pay/{session_id}             {outcome: succeed | fail | authorize}
Test controls (what a provider's test mode dashboard offers):
  GET/POST /sandbox/config           delivery mode (auto | hold), duplicates, delay,
                                     reorder window, drop rate, refund mode, slow sessions
  GET  /sandbox/events?order_id=     the events generated, with their delivery state
  POST /sandbox/deliver              {event_ids, copies?, concurrent?}: deliver now, once
  POST /sandbox/seed/payment         a payment no session asked for (divergences)
  POST /sandbox/seed/refund          a refund the gate did not ask for
  POST /sandbox/refunds/{id}/settle  {outcome: succeed | fail} for pending refunds
  GET  /sandbox/stats

Events are signed with Standard Webhooks and delivered with retries and
exponential backoff until a 2xx (bounded attempts). State is in memory and bounded:
a restart forgets everything, as a test mode may.

It is a development tool, fenced in (docs/payments.md, "The sandbox provider"):

  gate sandbox ──> GATE_ENV=dev?  no ──> exit 2
                   signs with GATE_SANDBOX_WEBHOOK_SECRET (never GATE_WEBHOOK_SECRET;
                   the built-in dev secret when unset)
  request ──> GATE_SANDBOX_API_KEY set? ──> Bearer key required on every route but
              /healthz, the buyer's /pay/{session_id} included (it moves money; with a
              key set, pay with the key, e.g. curl; leave the key unset to click the
              page in a browser)
  callback ──> target host in GATE_SANDBOX_NOTIFY_ALLOW (loopback by default)? else 400
              at the control that named it (exit 2 for GATE_SANDBOX_WEBHOOK_URL);
              redirects are not followed
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import hmac
import html
import ipaddress
import logging
import os
import random
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gate.base.settings import DEV_WEBHOOK_SECRET, SettingsError, env_float, env_int
from gate.payments.signing import decode_secret, sign_headers
from gate.web.http_io import exact_paths

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
            backoff = min(cfg.backoff_max_seconds, cfg.backoff_base_seconds * 2**attempt)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
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


# -- request helpers -------------------------------------------------------------------


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > BODY_MAX_BYTES:
        raise BadRequest(413, "too_large", "Body too large.")
    if not raw:
        return {}
    if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        form = await request.form()
        return {k: str(v) for k, v in form.items()}
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(400, "invalid_json", "Body is not JSON.") from None
    if not isinstance(doc, dict):
        raise BadRequest(400, "invalid_json", "Body must be an object.")
    return doc


def _int(doc: Mapping[str, Any], name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(400, "invalid_request", f"'{name}' must be an integer in {lo}..{hi}.")
    return value


def _str(doc: Mapping[str, Any], name: str, max_len: int = 191, required: bool = True) -> str:
    value = doc.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not 1 <= len(value) <= max_len:
        raise BadRequest(400, "invalid_request", f"'{name}' must be a string of 1-{max_len}.")
    return value


def _sandbox(request: Request) -> Sandbox:
    sb: Sandbox = request.app.state.sandbox
    return sb


# Open without the key: the health probe only. The buyer's /pay step moves money, so it
# needs the key too (an unguessable session id is a capability only until it leaks in
# a log or a referrer).
OPEN_PATHS = ("/healthz",)


class ApiKeyGuard:
    """With GATE_SANDBOX_API_KEY set, every route but OPEN_PATHS needs
    `Authorization: Bearer <key>`, the /sandbox/* controls included."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            await _error(401, "unauthorized", "Missing or invalid API key.")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _url_field(sb: Sandbox, doc: Mapping[str, Any], name: str, *, notify: bool) -> str | None:
    """An optional URL in a request: absent/null/"" is None; a notify target must be
    on the allow-list (GATE_SANDBOX_NOTIFY_ALLOW)."""
    value = doc.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > URL_MAX_CHARS:
        raise BadRequest(
            400, "invalid_request", f"'{name}' must be a URL of at most {URL_MAX_CHARS} characters."
        )
    if notify and not sb.config.notify_allow.allows(value):
        raise BadRequest(
            400,
            "notify_url_not_allowed",
            f"'{name}' must be an http(s) URL whose host is in GATE_SANDBOX_NOTIFY_ALLOW.",
        )
    return value


def _flag(doc: Mapping[str, Any], name: str, default: bool) -> bool:
    value = doc.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(400, "invalid_request", f"'{name}' must be true or false.")
    return value


# -- provider API ----------------------------------------------------------------------


async def create_session(request: Request) -> Response:
    sb = _sandbox(request)
    doc = await _body(request)
    order_id = _str(doc, "order_id", 64)
    amount = _int(doc, "amount")
    currency = _str(doc, "currency", 3)
    capture = doc.get("capture_method", "automatic")
    if capture not in ("automatic", "manual"):
        raise BadRequest(400, "invalid_request", "capture_method: automatic or manual.")
    expires_at = _int(doc, "expires_at", 0, 2**40)
    notify_url = _url_field(sb, doc, "notify_url", notify=True)
    return_url = _url_field(sb, doc, "return_url", notify=False)
    description = doc.get("description") or ""
    if not isinstance(description, str):
        raise BadRequest(400, "invalid_request", "'description' must be a string.")
    description = description[:200]

    def make() -> tuple[int, dict[str, Any]]:
        sb._room()
        sid = _id("cs")
        s = SbSession(
            sid,
            order_id,
            amount,
            currency,
            str(capture),
            expires_at,
            notify_url,
            return_url,
            description,
            f"{sb.config.public_url}/pay/{sid}",
        )
        sb.sessions[sid] = s
        sb.sessions_by_order.setdefault(order_id, []).append(sid)
        return 200, sb.session_view(s)

    fingerprint = {k: doc.get(k) for k in ("order_id", "amount", "currency", "capture_method")}
    resp = await sb.idempotent("session", request.headers.get("idempotency-key"), fingerprint, make)
    if sb.controls.session_delay_seconds > 0:
        # The session exists now; answering late is how a creation "times out".
        await asyncio.sleep(sb.controls.session_delay_seconds)
    return resp


async def list_sessions(request: Request) -> Response:
    sb = _sandbox(request)
    order_id = request.query_params.get("order_id", "")
    items = [sb.session_view(sb.sessions[s]) for s in sb.sessions_by_order.get(order_id, [])]
    return _json({"data": items})


async def list_payments(request: Request) -> Response:
    sb = _sandbox(request)
    order_id = request.query_params.get("order_id", "")
    items = [sb.payment_view(sb.payments[p]) for p in sb.payments_by_order.get(order_id, [])]
    return _json({"data": items})


async def get_payment(request: Request) -> Response:
    sb = _sandbox(request)
    p = sb.payments.get(request.path_params["payment_id"])
    if p is None:
        return _error(404, "not_found", "No such payment.")
    return _json(sb.payment_view(p))


async def capture(request: Request) -> Response:
    sb = _sandbox(request)
    pid = request.path_params["payment_id"]
    doc = await _body(request)
    p = sb.payments.get(pid)
    if p is None:
        return _error(404, "not_found", "No such payment.")
    amount = _int(doc, "amount") if "amount" in doc else p.amount

    def make() -> tuple[int, dict[str, Any]]:
        if p.status == "succeeded":
            return 200, sb.payment_view(p)
        if p.status != "authorized":
            raise BadRequest(
                409, f"payment_{p.status}", f"Payment is {p.status}.", payment=sb.payment_view(p)
            )
        if amount > p.amount:
            raise BadRequest(409, "amount_exceeds_authorized", "Amount above the authorization.")
        p.status = "succeeded"
        p.captured_amount = amount
        sb.emit_payment(p)
        return 200, sb.payment_view(p)

    return await sb.idempotent(
        "capture", request.headers.get("idempotency-key"), {"p": pid, "a": amount}, make
    )


async def void(request: Request) -> Response:
    sb = _sandbox(request)
    pid = request.path_params["payment_id"]
    p = sb.payments.get(pid)
    if p is None:
        return _error(404, "not_found", "No such payment.")

    def make() -> tuple[int, dict[str, Any]]:
        if p.status == "voided":
            return 200, sb.payment_view(p)
        if p.status != "authorized":
            raise BadRequest(
                409, f"payment_{p.status}", f"Payment is {p.status}.", payment=sb.payment_view(p)
            )
        p.status = "voided"
        sb.emit_payment(p)
        return 200, sb.payment_view(p)

    return await sb.idempotent("void", request.headers.get("idempotency-key"), {"p": pid}, make)


async def create_refund(request: Request) -> Response:
    sb = _sandbox(request)
    doc = await _body(request)
    pid = _str(doc, "payment_id")
    amount = _int(doc, "amount", 1)
    p = sb.payments.get(pid)
    if p is None:
        return _error(404, "not_found", "No such payment.")

    def make() -> tuple[int, dict[str, Any]]:
        return 200, asdict(sb.new_refund(p, amount))

    return await sb.idempotent(
        "refund", request.headers.get("idempotency-key"), {"p": pid, "a": amount}, make
    )


async def get_refund(request: Request) -> Response:
    sb = _sandbox(request)
    r = sb.refunds.get(request.path_params["refund_id"])
    if r is None:
        return _error(404, "not_found", "No such refund.")
    return _json(asdict(r))


async def transactions(request: Request) -> Response:
    sb = _sandbox(request)
    after = request.query_params.get("after", "0")
    limit = request.query_params.get("limit", "100")
    since = request.query_params.get("created_gte", "0")
    if not after.isdigit() or not limit.isdigit() or not 1 <= int(limit) <= 1000:
        return _error(400, "invalid_request", "after: a cursor; limit: 1..1000.")
    if not since.isdigit() or len(since) > 12:
        return _error(400, "invalid_request", "created_gte: unix seconds.")
    # The log is in creation order, so a time window starts at one position in it.
    first = bisect.bisect_left(sb.log, int(since), key=sb.created_of) if int(since) else 0
    start, n = max(int(after), first), int(limit)
    items = []
    for kind, oid in sb.log[start : start + n]:
        if kind == "payment":
            p = sb.payments[oid]
            items.append(
                {
                    "kind": "payment",
                    "id": p.id,
                    "payment_id": p.id,
                    "order_id": p.order_id,
                    "amount": p.captured_amount if p.status == "succeeded" else p.amount,
                    "currency": p.currency,
                    "status": p.status,
                    "created": p.created,
                }
            )
        else:
            r = sb.refunds[oid]
            items.append(
                {
                    "kind": "refund",
                    "id": r.id,
                    "payment_id": r.payment_id,
                    "order_id": r.order_id,
                    "amount": r.amount,
                    "currency": r.currency,
                    "status": r.status,
                    "created": r.created,
                }
            )
    end = start + len(items)
    return _json({"data": items, "next": str(end) if end < len(sb.log) else None})


# -- the buyer's step -------------------------------------------------------------------

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Sandbox payment</title></head>
<body><h1>Sandbox payment</h1><p>{description}</p><p>Order {order_id}: {amount} {currency}
(minor units), capture {capture}.</p>
<form method="post"><button name="outcome" value="succeed">Pay</button>
<button name="outcome" value="authorize">Authorize only</button>
<button name="outcome" value="fail">Fail</button></form></body></html>"""


async def pay_page(request: Request) -> Response:
    sb = _sandbox(request)
    s = sb.sessions.get(request.path_params["session_id"])
    if s is None:
        return _error(404, "not_found", "No such session.")
    return HTMLResponse(
        PAGE.format(
            description=html.escape(s.description),
            order_id=html.escape(s.order_id),
            amount=s.amount,
            currency=html.escape(s.currency),
            capture=s.capture_method,
        )
    )


async def pay(request: Request) -> Response:
    sb = _sandbox(request)
    s = sb.sessions.get(request.path_params["session_id"])
    if s is None:
        return _error(404, "not_found", "No such session.")
    doc = await _body(request)
    outcome = doc.get("outcome")
    if outcome not in ("succeed", "fail", "authorize"):
        return _error(400, "invalid_request", "outcome: succeed, fail or authorize.")
    if s.status == "complete" and outcome != "fail":
        return _error(409, "session_complete", "This session was already paid.")
    if outcome == "fail":
        status = "failed"
    elif outcome == "authorize" or s.capture_method == "manual":
        status = "authorized"
    else:
        status = "succeeded"
    if status != "failed":
        s.status = "complete"
    p = sb.new_payment(s.order_id, s.id, s.amount, s.currency, status, s.notify_url)
    sb.emit_payment(p)
    return _json(sb.payment_view(p))


# -- test controls ----------------------------------------------------------------------


def _choice(*allowed: str) -> Any:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, str) or value not in allowed:
            raise BadRequest(
                400, "invalid_request", f"'{name}' must be one of {', '.join(allowed)}."
            )
        return value

    return check


def _number(lo: float, hi: float, *, integer: bool = False) -> Any:
    def check(name: str, value: Any) -> Any:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
            kind = "an integer" if integer else "a number"
            raise BadRequest(400, "invalid_request", f"'{name}' must be {kind} in {lo:g}..{hi:g}.")
        return value if integer else float(value)

    return check


# Each control's check: a value of the wrong type or range is refused, never stored.
CONTROL_CHECKS: dict[str, Any] = {
    "mode": _choice("auto", "hold"),
    "duplicates": _number(0, 100, integer=True),
    "delay_seconds": _number(0, CONTROL_SECONDS_MAX),
    "reorder_window_seconds": _number(0, CONTROL_SECONDS_MAX),
    "drop_rate": _number(0, 1),
    "refund_mode": _choice("succeed", "fail", "pending"),
    "session_delay_seconds": _number(0, CONTROL_SECONDS_MAX),
}


async def controls(request: Request) -> Response:
    """Read or change the delivery controls; a request with any bad control changes
    nothing (400 problem+json)."""
    sb = _sandbox(request)
    if request.method == "POST":
        doc = await _body(request)
        changes: dict[str, Any] = {}
        for name, value in doc.items():
            if name == "webhook_url":
                changes[name] = _url_field(sb, doc, name, notify=True)
                continue
            check = CONTROL_CHECKS.get(name)
            if check is None:
                return _error(400, "invalid_request", f"Unknown control {name!r}.")
            changes[name] = check(name, value)
        for name, value in changes.items():
            setattr(sb.controls, name, value)
    return _json(asdict(sb.controls))


async def list_events(request: Request) -> Response:
    sb = _sandbox(request)
    order_id = request.query_params.get("order_id")
    event_type = request.query_params.get("type")
    items = [
        e.view()
        for e in sb.events.values()
        if (order_id is None or e.order_id == order_id)
        and (event_type is None or e.type == event_type)
    ]
    return _json({"data": items[-1000:]})


async def deliver(request: Request) -> Response:
    """Deliver the given events now, one attempt per copy, in the order given; with
    `concurrent`, all copies of one event are sent at once. Returns the statuses."""
    sb = _sandbox(request)
    doc = await _body(request)
    ids = doc.get("event_ids")
    copies = doc.get("copies", 1)
    concurrent = _flag(doc, "concurrent", False)
    if (
        not isinstance(ids, list)
        or not 1 <= len(ids) <= 1000
        or not all(isinstance(i, str) for i in ids)
        or isinstance(copies, bool)
        or not isinstance(copies, int)
        or not 1 <= copies <= 200
    ):
        return _error(400, "invalid_request", "event_ids: a list of 1-1000 ids; copies: 1..200")
    results: list[list[int]] = []
    for eid in ids:
        event = sb.events.get(eid)
        if event is None:
            return _error(404, "not_found", f"No such event {eid}.")
        if concurrent:
            statuses = list(await asyncio.gather(*(sb._send(event) for _ in range(copies))))
        else:
            statuses = [await sb._send(event) for _ in range(copies)]
        results.append(statuses)
    return _json({"statuses": results})


async def seed_payment(request: Request) -> Response:
    """A payment no gate session asked for: a payment the gate never heard of, a
    second payment for one order, a wrong amount. `emit`: also send its event."""
    sb = _sandbox(request)
    doc = await _body(request)
    status = doc.get("status", "succeeded")
    if not isinstance(status, str) or status not in ("succeeded", "authorized", "failed"):
        return _error(400, "invalid_request", "status: succeeded, authorized or failed")
    order_id = _str(doc, "order_id", 64)
    amount = _int(doc, "amount")
    currency = _str(doc, "currency", 3)
    notify_url = _url_field(sb, doc, "notify_url", notify=True)
    emit = _flag(doc, "emit", True)
    p = sb.new_payment(order_id, None, amount, currency, status, notify_url)
    event = sb.emit_payment(p) if emit else None
    return _json({**sb.payment_view(p), "event_id": event.id if event else None})


async def seed_refund(request: Request) -> Response:
    sb = _sandbox(request)
    doc = await _body(request)
    p = sb.payments.get(_str(doc, "payment_id"))
    if p is None:
        return _error(404, "not_found", "No such payment.")
    r = sb.new_refund(p, _int(doc, "amount", 1), force=_flag(doc, "force", False))
    return _json(asdict(r))


async def settle_refund(request: Request) -> Response:
    sb = _sandbox(request)
    r = sb.refunds.get(request.path_params["refund_id"])
    if r is None:
        return _error(404, "not_found", "No such refund.")
    doc = await _body(request)
    outcome = doc.get("outcome")
    if outcome not in ("succeed", "fail"):
        return _error(400, "invalid_request", "outcome: succeed or fail")
    sb.settle_refund(r, str(outcome))
    return _json(asdict(r))


async def stats(request: Request) -> Response:
    sb = _sandbox(request)
    states: dict[str, int] = {}
    for e in sb.events.values():
        states[e.state] = states.get(e.state, 0) + 1
    return _json(
        {
            **sb.stats,
            "events": states,
            "sessions": len(sb.sessions),
            "payments": len(sb.payments),
            "refunds": len(sb.refunds),
            "in_flight": len(sb._tasks),
        }
    )


async def healthz(request: Request) -> Response:
    return _json({"status": "ok"})


async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return exc.response


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 as problem+json, like every other refusal."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
    return _error(exc.status_code, code, str(exc.detail))


def load_config(env: Mapping[str, str], host: str, port: int) -> SandboxConfig:
    """The sandbox's settings; SettingsError (exit 2) outside GATE_ENV=dev or on a bad
    value. It fakes payments and signs callbacks: it never runs in production."""
    gate_env = env.get("GATE_ENV", "production").strip().lower() or "production"
    if gate_env != "dev":
        raise SettingsError(
            f"gate sandbox runs only with GATE_ENV=dev (got GATE_ENV={gate_env!r}): it is a"
            " fake payment provider for development and tests"
        )
    # Its own secret, never the gate's GATE_WEBHOOK_SECRET: the gate is told to trust
    # the sandbox's secret explicitly, not by sharing a variable.
    raw = env.get("GATE_SANDBOX_WEBHOOK_SECRET", "").strip() or DEV_WEBHOOK_SECRET
    keys = tuple(decode_secret(s) for s in raw.split())
    allow = NotifyAllow.parse(
        "GATE_SANDBOX_NOTIFY_ALLOW",
        env.get("GATE_SANDBOX_NOTIFY_ALLOW", "").strip() or NOTIFY_ALLOW_DEFAULT,
    )
    public = env.get("GATE_SANDBOX_PUBLIC_URL", "").strip() or f"http://{host}:{port}"
    webhook = (
        env.get("GATE_SANDBOX_WEBHOOK_URL", "").strip()
        or "http://127.0.0.1:8000/v1/payments/sandbox/webhook"
    )
    if not allow.allows(webhook):
        raise SettingsError(
            f"GATE_SANDBOX_WEBHOOK_URL {webhook!r} is not an http(s) URL on a host in"
            " GATE_SANDBOX_NOTIFY_ALLOW"
        )
    return SandboxConfig(
        webhook_url=webhook,
        public_url=public.rstrip("/"),
        signing_keys=keys,
        api_key=env.get("GATE_SANDBOX_API_KEY", "").strip() or None,
        notify_allow=allow,
        retry_max=env_int(env, "GATE_SANDBOX_RETRY_MAX", 12, 1, 100),
        backoff_base_seconds=env_float(env, "GATE_SANDBOX_BACKOFF_BASE_SECONDS", 0.5, 0.01, 60),
        backoff_max_seconds=env_float(env, "GATE_SANDBOX_BACKOFF_MAX_SECONDS", 60.0, 0.1, 3600),
        delivery_timeout_seconds=env_float(
            env, "GATE_SANDBOX_DELIVERY_TIMEOUT_SECONDS", 10.0, 0.1, 120
        ),
        deliveries_max=env_int(env, "GATE_SANDBOX_DELIVERIES_MAX", 256, 1, 10_000),
        objects_max=env_int(env, "GATE_SANDBOX_OBJECTS_MAX", 1_000_000, 100, 100_000_000),
    )


def build_sandbox_app(config: SandboxConfig) -> Starlette:
    sandbox = Sandbox(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await sandbox.close()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/v1/sessions", create_session, methods=["POST"]),
            Route("/v1/sessions", list_sessions, methods=["GET"]),
            Route("/v1/payments", list_payments, methods=["GET"]),
            Route("/v1/payments/{payment_id}", get_payment, methods=["GET"]),
            Route("/v1/payments/{payment_id}/capture", capture, methods=["POST"]),
            Route("/v1/payments/{payment_id}/void", void, methods=["POST"]),
            Route("/v1/refunds", create_refund, methods=["POST"]),
            Route("/v1/refunds/{refund_id}", get_refund, methods=["GET"]),
            Route("/v1/transactions", transactions, methods=["GET"]),
            Route("/pay/{session_id}", pay_page, methods=["GET"]),
            Route("/pay/{session_id}", pay, methods=["POST"]),
            Route("/sandbox/config", controls, methods=["GET", "POST"]),
            Route("/sandbox/events", list_events, methods=["GET"]),
            Route("/sandbox/deliver", deliver, methods=["POST"]),
            Route("/sandbox/seed/payment", seed_payment, methods=["POST"]),
            Route("/sandbox/seed/refund", seed_refund, methods=["POST"]),
            Route("/sandbox/refunds/{refund_id}/settle", settle_refund, methods=["POST"]),
            Route("/sandbox/stats", stats, methods=["GET"]),
        ],
        exception_handlers={BadRequest: _bad_request, HTTPException: _http_error},
        middleware=[Middleware(ApiKeyGuard, api_key=config.api_key)],
        lifespan=lifespan,
    )
    # Its paths, external input too, match exactly (\Z), as the gate's do.
    exact_paths(app.routes)
    app.state.sandbox = sandbox
    return app


def create_sandbox_app() -> Starlette:
    """uvicorn factory (`gate sandbox`): host and port come from the command."""
    host = os.environ.get("GATE_SANDBOX_HOST", "127.0.0.1")
    port = int(os.environ.get("GATE_SANDBOX_PORT", "8090"))
    return build_sandbox_app(load_config(os.environ, host, port))
