"""The sandbox payment provider: a separate HTTP service (`gate sandbox`), the way
payment platforms offer a test mode.

Provider API (what the gate calls; changing calls require `Idempotency-Key`):
  POST /v1/sessions                  {order_id, amount, currency, capture_method,
                                      expires_at, description?, notify_url?, return_url?}
                                     (the session keeps the call's W3C traceparent)
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
import hmac
import html
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gate.base.settings import (
    DEV_WEBHOOK_SECRET,
    SettingsError,
    env_float,
    env_int,
    with_secret_files,
)
from gate.payments.sandbox.state import (
    BODY_MAX_BYTES,
    CONTROL_SECONDS_MAX,
    NOTIFY_ALLOW_DEFAULT,
    URL_MAX_CHARS,
    BadRequest,
    NotifyAllow,
    Sandbox,
    SandboxConfig,
    SbSession,
    _error,
    _id,
    _json,
)
from gate.payments.signing import decode_secret
from gate.web.http_io import exact_paths

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


def _traceparent(request: Request) -> str | None:
    value = request.headers.get("traceparent")
    return value if value and len(value) <= 128 and value.isprintable() else None


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
            traceparent=_traceparent(request),
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
    env = with_secret_files(env)
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
