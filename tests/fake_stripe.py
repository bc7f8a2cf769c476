"""A local fake of the parts of Stripe's API the gate uses, for tests only.

Follows Stripe's published API reference (https://docs.stripe.com/api):
form-encoded requests with nested keys (`metadata[order_id]`), Bearer secret keys,
`Idempotency-Key` (the same key replays the first answer with `Idempotent-Replayed:
true`; the same key with other parameters is a 400 `idempotency_error`), errors as
`{"error": {"type", "code", "message", "param"}}`, lists as `{"object": "list",
"data", "has_more"}` newest first with `starting_after`/`created[gte]`, the search
query `metadata['order_id']:'…'`, `Stripe-Version` (this fake speaks one version, the
adapter's `API_VERSION`: a request without the header or with another version is a 400
`invalid_request_error`, so a gate that forgot it fails here rather than against an
account whose default version differs), and webhook deliveries signed as
https://docs.stripe.com/webhooks#verify-manually documents:
`Stripe-Signature: t=<unix>,v1=<hex HMAC-SHA256 of "{t}.{payload}" with the
endpoint secret>`, retried with backoff until a 2xx.

Test controls under /fake/* (the buyer's pay step, holding or dropping deliveries,
delivering by id, settling a pending refund, throttling the API with 429/503 and
Retry-After, the API requests' arrival times, the api_version events are rendered
at, the Stripe-Versions requests came with). Run: python -m tests.fake_stripe
--port N with FAKE_STRIPE_API_KEY, FAKE_STRIPE_WEBHOOK_SECRET, FAKE_STRIPE_WEBHOOK_URL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import hmac
import itertools
import os
import re
import secrets
import time
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gate.payments.providers.stripe import API_VERSION

DELIVERY_ATTEMPTS_MAX = 6
DELIVERY_BACKOFF_SECONDS = 0.1
_seq = itertools.count(1)


def new_id(prefix: str) -> str:
    # Sortable by creation (a sequence), unguessable enough for a test.
    return f"{prefix}_{next(_seq):08d}{secrets.token_hex(6)}"


def answer(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), status, headers, media_type="application/json")


def error(
    status: int, etype: str, message: str, code: str | None = None, param: str | None = None
) -> Response:
    err: dict[str, Any] = {"type": etype, "message": message}
    if code:
        err["code"] = code
    if param:
        err["param"] = param
    return answer({"error": err}, status)


def nest(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Stripe's form keys a[b][0][c] back into objects (lists as index-keyed dicts)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        parts = re.findall(r"[^\[\]]+", key)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def signature(secret: str, timestamp: int, payload: bytes) -> str:
    signed = f"{timestamp}.".encode() + payload
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


class FakeStripe:
    def __init__(self, api_key: str, webhook_secret: str, webhook_url: str, port: int) -> None:
        self.api_key = api_key
        self.webhook_secret = webhook_secret
        self.webhook_url = webhook_url
        self.port = port
        self.sessions: dict[str, dict[str, Any]] = {}
        self.intents: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}
        self.idempotency: dict[str, tuple[bytes, int, bytes]] = {}
        # sign_with: another secret to sign deliveries with (a misconfigured endpoint).
        self.config: dict[str, Any] = {
            "hold": False,
            "drop": False,
            "refund_mode": "succeed",
            "sign_with": None,
            # Answers given before any API request is looked at, one a request:
            # [[status, Retry-After or null], …] (a throttled or unavailable API).
            "throttle": [],
            # The api_version events are rendered at (an endpoint set to another one).
            "event_api_version": API_VERSION,
        }
        # (path, monotonic seconds, status) of the latest API requests.
        self.arrivals: list[tuple[str, float, int]] = []
        # How many API requests came with each Stripe-Version ("" for none).
        self.versions: collections.Counter[str] = collections.Counter()
        self.tasks: set[asyncio.Task[None]] = set()
        self.http: aiohttp.ClientSession | None = None

    # -- plumbing -------------------------------------------------------------------

    async def api(self, request: Request) -> Response:
        resp = await self._api(request)
        self.arrivals = [
            *self.arrivals[-999:],
            (request.url.path, time.monotonic(), resp.status_code),
        ]
        return resp

    async def _api(self, request: Request) -> Response:
        if self.config["throttle"]:
            status, retry_after = self.config["throttle"].pop(0)
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
            kind = "rate_limit_error" if status == 429 else "api_error"
            return answer({"error": {"type": kind, "message": "Try again later."}}, status, headers)
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return error(401, "invalid_request_error", "Invalid API Key provided.")
        version = request.headers.get("stripe-version")
        self.versions[version or ""] += 1
        if version != API_VERSION:
            return error(
                400,
                "invalid_request_error",
                f"Invalid Stripe API version: {version!r} (this account reads {API_VERSION}).",
                param="Stripe-Version",
            )
        if request.method == "POST":
            params = nest(parse_qsl((await request.body()).decode(), keep_blank_values=True))
        else:
            params = nest(list(request.query_params.multi_items()))
        key = request.headers.get("idempotency-key")
        route = request.scope["endpoint_name"]
        if request.method == "POST" and key:
            fingerprint = orjson.dumps([request.url.path, params], option=orjson.OPT_SORT_KEYS)
            seen = self.idempotency.get(key)
            if seen is not None:
                if seen[0] != fingerprint:
                    return error(
                        400,
                        "idempotency_error",
                        "Keys for idempotent requests can only be used with the same"
                        " parameters they were first used with.",
                    )
                return Response(
                    seen[2], seen[1], {"Idempotent-Replayed": "true"}, "application/json"
                )
        resp: Response = await getattr(self, route)(request, params)
        if request.method == "POST" and key and resp.status_code < 500:
            self.idempotency[key] = (fingerprint, resp.status_code, bytes(resp.body))
        return resp

    def emit(self, event_type: str, obj: dict[str, Any]) -> dict[str, Any]:
        event = {
            "id": new_id("evt"),
            "object": "event",
            "api_version": self.config["event_api_version"],
            "created": int(time.time()),
            "livemode": False,
            "pending_webhooks": 1,
            "type": event_type,
            "data": {"object": dict(obj)},
            "order_id": (obj.get("metadata") or {}).get("order_id"),
            "deliveries": [],
        }
        self.events[event["id"]] = event
        if not self.config["hold"] and not self.config["drop"]:
            task = asyncio.create_task(self.deliver(event["id"], retries=True))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return event

    def payload(self, event: dict[str, Any]) -> bytes:
        return orjson.dumps({k: v for k, v in event.items() if k not in ("order_id", "deliveries")})

    async def deliver(self, event_id: str, retries: bool) -> int:
        event = self.events[event_id]
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        status = 0
        for attempt in range(DELIVERY_ATTEMPTS_MAX if retries else 1):
            if attempt:
                await asyncio.sleep(DELIVERY_BACKOFF_SECONDS * 2**attempt)
            body = self.payload(event)
            headers = {
                "Content-Type": "application/json; charset=utf-8",
                "Stripe-Signature": signature(
                    self.config.get("sign_with") or self.webhook_secret, int(time.time()), body
                ),
            }
            try:
                async with self.http.post(self.webhook_url, data=body, headers=headers) as r:
                    status = r.status
            except (aiohttp.ClientError, OSError, TimeoutError):
                status = 0
            event["deliveries"].append(status)
            if 200 <= status < 300:
                break
        return status

    # -- Checkout Sessions ----------------------------------------------------------

    async def create_session(self, request: Request, p: dict[str, Any]) -> Response:
        if p.get("mode") != "payment":
            return error(400, "invalid_request_error", "mode must be payment", param="mode")
        try:
            item = p["line_items"]["0"]
            amount = int(item["price_data"]["unit_amount"]) * int(item.get("quantity", "1"))
            currency = item["price_data"]["currency"]
        except (KeyError, ValueError, TypeError):
            return error(400, "invalid_request_error", "Missing line_items.", param="line_items")
        now = int(time.time())
        expires_at = int(p.get("expires_at", now + 86_400))
        if not now + 1800 - 5 <= expires_at <= now + 86_400 + 5:
            return error(
                400,
                "invalid_request_error",
                "The expires_at timestamp must be between 30 minutes and 24 hours from now.",
                param="expires_at",
            )
        pi_data = p.get("payment_intent_data") or {}
        cs = {
            "id": new_id("cs_test"),
            "object": "checkout.session",
            "mode": "payment",
            "amount_total": amount,
            "currency": currency,
            "client_reference_id": p.get("client_reference_id"),
            "metadata": p.get("metadata") or {},
            "expires_at": expires_at,
            "status": "open",
            "payment_status": "unpaid",
            "payment_intent": None,
            "created": now,
            "_capture_method": pi_data.get("capture_method", "automatic"),
            "_pi_metadata": pi_data.get("metadata") or {},
        }
        cs["url"] = f"http://127.0.0.1:{self.port}/fake/checkout/{cs['id']}"
        self.sessions[cs["id"]] = cs
        return answer(self.public(cs))

    @staticmethod
    def public(obj: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if not k.startswith("_")}

    # -- PaymentIntents --------------------------------------------------------------

    def missing(self, what: str, ident: str) -> Response:
        return error(
            404, "invalid_request_error", f"No such {what}: '{ident}'", code="resource_missing"
        )

    async def get_intent(self, request: Request, p: dict[str, Any]) -> Response:
        pi = self.intents.get(request.path_params["id"])
        return answer(pi) if pi else self.missing("payment_intent", request.path_params["id"])

    async def search_intents(self, request: Request, p: dict[str, Any]) -> Response:
        m = re.fullmatch(r"metadata\['order_id'\]:'([^']*)'", p.get("query", ""))
        if m is None:
            return error(400, "invalid_request_error", "Unsupported query.", param="query")
        found = [pi for pi in self.intents.values() if pi["metadata"].get("order_id") == m[1]]
        return answer({"object": "search_result", "data": found, "has_more": False})

    def listing(self, objects: dict[str, dict[str, Any]], p: dict[str, Any]) -> Response:
        items = sorted(objects.values(), key=lambda o: o["id"][o["id"].index("_") + 1 :])
        items.reverse()  # newest first, as Stripe lists
        gte = (p.get("created") or {}).get("gte")
        if gte is not None:
            items = [o for o in items if o["created"] >= int(gte)]
        after = p.get("starting_after")
        if after:
            ids = [o["id"] for o in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        limit = max(1, min(100, int(p.get("limit", 10))))
        return answer({"object": "list", "data": items[:limit], "has_more": len(items) > limit})

    async def list_intents(self, request: Request, p: dict[str, Any]) -> Response:
        return self.listing(self.intents, p)

    async def capture(self, request: Request, p: dict[str, Any]) -> Response:
        pi = self.intents.get(request.path_params["id"])
        if pi is None:
            return self.missing("payment_intent", request.path_params["id"])
        if pi["status"] != "requires_capture":
            return error(
                400,
                "invalid_request_error",
                f"This PaymentIntent could not be captured because it has a status of"
                f" {pi['status']}.",
                code="payment_intent_unexpected_state",
            )
        amount = int(p.get("amount_to_capture", pi["amount_capturable"]))
        if amount > pi["amount_capturable"]:
            return error(
                400,
                "invalid_request_error",
                "amount_to_capture too large",
                code="amount_too_large",
                param="amount_to_capture",
            )
        pi.update(status="succeeded", amount_received=amount, amount_capturable=0)
        self.emit("payment_intent.succeeded", pi)
        return answer(pi)

    async def cancel(self, request: Request, p: dict[str, Any]) -> Response:
        pi = self.intents.get(request.path_params["id"])
        if pi is None:
            return self.missing("payment_intent", request.path_params["id"])
        if pi["status"] in ("succeeded", "canceled"):
            return error(
                400,
                "invalid_request_error",
                f"You cannot cancel this PaymentIntent because it has a status of {pi['status']}.",
                code="payment_intent_unexpected_state",
            )
        pi.update(status="canceled", cancellation_reason=p.get("cancellation_reason"))
        self.emit("payment_intent.canceled", pi)
        return answer(pi)

    # -- Refunds ----------------------------------------------------------------------

    def charge_of(self, pi: dict[str, Any]) -> dict[str, Any]:
        mine = [r for r in self.refunds.values() if r["payment_intent"] == pi["id"]]
        mine.sort(key=lambda r: r["id"], reverse=True)
        refunded = sum(r["amount"] for r in mine if r["status"] in ("succeeded", "pending"))
        return {
            "id": pi["latest_charge"],
            "object": "charge",
            "amount": pi["amount"],
            "amount_captured": pi["amount_received"],
            "amount_refunded": refunded,
            "currency": pi["currency"],
            "payment_intent": pi["id"],
            "metadata": pi["metadata"],
            "refunded": refunded >= pi["amount_received"],
            "refunds": {"object": "list", "data": mine, "has_more": False},
        }

    async def create_refund(self, request: Request, p: dict[str, Any]) -> Response:
        pi = self.intents.get(p.get("payment_intent", ""))
        if pi is None:
            return self.missing("payment_intent", p.get("payment_intent", ""))
        if pi["status"] != "succeeded":
            return error(
                400,
                "invalid_request_error",
                "This PaymentIntent has no charge to refund.",
                code="charge_not_refundable",
            )
        refunded = sum(
            r["amount"]
            for r in self.refunds.values()
            if r["payment_intent"] == pi["id"] and r["status"] in ("succeeded", "pending")
        )
        amount = int(p.get("amount", pi["amount_received"] - refunded))
        if amount <= 0 or refunded + amount > pi["amount_received"]:
            code = (
                "charge_already_refunded"
                if refunded >= pi["amount_received"]
                else ("amount_too_large")
            )
            return error(
                400,
                "invalid_request_error",
                "Refund amount is greater than unrefunded amount on charge.",
                code=code,
                param="amount",
            )
        mode = self.config["refund_mode"]
        refund = {
            "id": new_id("re"),
            "object": "refund",
            "amount": amount,
            "currency": pi["currency"],
            "payment_intent": pi["id"],
            "charge": pi["latest_charge"],
            "metadata": p.get("metadata") or {},
            "status": "succeeded" if mode == "succeed" else "pending",
            "created": int(time.time()),
        }
        self.refunds[refund["id"]] = refund
        if refund["status"] == "succeeded":
            self.emit("charge.refunded", self.charge_of(pi))
        return answer(refund)

    async def list_refunds(self, request: Request, p: dict[str, Any]) -> Response:
        return self.listing(self.refunds, p)

    # -- test controls -------------------------------------------------------------------

    def new_intent(self, cs: dict[str, Any], amount: int) -> dict[str, Any]:
        pi: dict[str, Any] = {
            "id": new_id("pi"),
            "object": "payment_intent",
            "amount": amount,
            "amount_capturable": 0,
            "amount_received": 0,
            "currency": cs["currency"],
            "capture_method": cs["_capture_method"],
            "metadata": dict(cs["_pi_metadata"]),
            "status": "requires_payment_method",
            "created": int(time.time()),
            "latest_charge": None,
            "last_payment_error": None,
        }
        self.intents[pi["id"]] = pi
        cs.update(payment_intent=pi["id"])
        return pi

    async def pay(self, request: Request) -> Response:
        cs = self.sessions.get(request.path_params["id"])
        if cs is None or cs["status"] != "open":
            return error(404, "invalid_request_error", "no open session", code="resource_missing")
        body = orjson.loads(await request.body() or b"{}")
        outcome = body.get("outcome", "succeed")
        amount = int(body.get("amount", cs["amount_total"]))
        manual = cs["_capture_method"] == "manual"
        # Checkout keeps one PaymentIntent per session: a retry after a declined card
        # confirms the same one again.
        pi = self.intents.get(cs["payment_intent"] or "")
        if pi is not None:
            pi.update(last_payment_error=None, amount=amount)
        else:
            pi = self.new_intent(cs, amount)
        if outcome == "fail":
            pi["last_payment_error"] = {"type": "card_error", "code": "card_declined"}
            event = self.emit("payment_intent.payment_failed", pi)
        else:
            pi["latest_charge"] = new_id("ch")
            cs.update(status="complete", payment_status="paid")
            if manual:
                pi.update(status="requires_capture", amount_capturable=amount)
                event = self.emit("payment_intent.amount_capturable_updated", pi)
            else:
                pi.update(status="succeeded", amount_received=amount)
                event = self.emit("payment_intent.succeeded", pi)
        return answer({"payment_intent": pi, "event": event["id"]})

    async def set_config(self, request: Request) -> Response:
        self.config.update(orjson.loads(await request.body() or b"{}"))
        return answer(self.config)

    async def list_events(self, request: Request) -> Response:
        order_id = request.query_params.get("order_id")
        etype = request.query_params.get("type")
        found = [
            {
                "id": e["id"],
                "type": e["type"],
                "deliveries": e["deliveries"],
                "payload": self.payload(e).decode(),
            }
            for e in self.events.values()
            if (order_id is None or e["order_id"] == order_id)
            and (etype is None or e["type"] == etype)
        ]
        return answer({"data": found})

    async def deliver_now(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        statuses = []
        for event_id in body["event_ids"]:
            statuses.append(
                [await self.deliver(event_id, retries=False) for _ in range(body.get("copies", 1))]
            )
        return answer({"statuses": statuses})

    async def settle_refund(self, request: Request) -> Response:
        refund = self.refunds[request.path_params["id"]]
        outcome = orjson.loads(await request.body())["outcome"]
        refund["status"] = "succeeded" if outcome == "succeed" else "failed"
        self.emit("refund.updated", refund)
        if refund["status"] == "succeeded":
            self.emit("charge.refunded", self.charge_of(self.intents[refund["payment_intent"]]))
        return answer(refund)

    async def list_arrivals(self, request: Request) -> Response:
        path = request.query_params.get("path")
        found = [
            {"path": p, "at": at, "status": status}
            for p, at, status in self.arrivals
            if path is None or p == path
        ]
        return answer({"data": found})

    async def list_versions(self, request: Request) -> Response:
        return answer({"versions": dict(self.versions)})

    async def healthz(self, request: Request) -> Response:
        return answer({"ok": True})

    def app(self) -> Starlette:
        def api(name: str, path: str, method: str) -> Route:
            async def endpoint(request: Request) -> Response:
                request.scope["endpoint_name"] = name
                return await self.api(request)

            return Route(path, endpoint, methods=[method])

        return Starlette(
            routes=[
                api("create_session", "/v1/checkout/sessions", "POST"),
                api("search_intents", "/v1/payment_intents/search", "GET"),
                api("list_intents", "/v1/payment_intents", "GET"),
                api("get_intent", "/v1/payment_intents/{id}", "GET"),
                api("capture", "/v1/payment_intents/{id}/capture", "POST"),
                api("cancel", "/v1/payment_intents/{id}/cancel", "POST"),
                api("create_refund", "/v1/refunds", "POST"),
                api("list_refunds", "/v1/refunds", "GET"),
                Route("/fake/checkout/{id}", self.pay, methods=["POST"]),
                Route("/fake/config", self.set_config, methods=["POST"]),
                Route("/fake/events", self.list_events, methods=["GET"]),
                Route("/fake/arrivals", self.list_arrivals, methods=["GET"]),
                Route("/fake/deliver", self.deliver_now, methods=["POST"]),
                Route("/fake/versions", self.list_versions, methods=["GET"]),
                Route("/fake/refunds/{id}/settle", self.settle_refund, methods=["POST"]),
                Route("/healthz", self.healthz, methods=["GET"]),
            ],
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    fake = FakeStripe(
        os.environ["FAKE_STRIPE_API_KEY"],
        os.environ["FAKE_STRIPE_WEBHOOK_SECRET"],
        os.environ["FAKE_STRIPE_WEBHOOK_URL"],
        args.port,
    )
    uvicorn.run(fake.app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
