"""Every header byte is handled: malformed bytes in any header the gate reads get the
route's 4xx problem, never a 5xx.

The requests are generated from the routes: the OpenAPI document the gate serves
names each operation's headers (its security scheme: Authorization; its header
parameters: Idempotency-Key, Admission-Token, webhook-*; a body: Content-Type), and
`EXTRA_HEADERS` / `CONSOLE_ROUTES` name what the document cannot (headers the gate
reads but does not document, the console's routes, each payment provider's
signature headers, taken from its webhook verifier's `header_names`). For every
route and every header it reads, a valid request is built and sent over a raw
socket with that one header's value replaced by malformed bytes: non-ASCII bytes
(0x80-0xff, which reach the application as latin-1 characters above 127), control
bytes (where the HTTP parser lets them through; where it does not, its 400 is the
answer), the valid value with its tail replaced (a token's signature), and values
of 16 KB (within the 32 KiB head bound). Each answer must be a 4xx
application/problem+json (the status `EXPECTED` names for that header), or, for a
header the gate only consults (X-Forwarded-For, X-Request-Id), the answer to the
same request without the bad value. The gate must answer /healthz after each
route and log no traceback.
"""

from __future__ import annotations

import itertools
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.routing import Route

from gate.api.app import build_app
from gate.base.ids import new_id
from gate.base.limits import client_ip, parse_networks
from gate.base.settings import Secret, load_settings
from gate.payments.providers.alipay import AlipayWebhook
from gate.payments.providers.rsa_http import sign_sha256_rsa
from gate.payments.providers.stripe import StripeWebhook
from gate.payments.providers.wechatpay import WechatPayWebhook, answer_message
from gate.payments.signing import decode_secret, sign_headers
from gate.room.tokens import AdmissionTokens
from tests.cn_support import KeyPair, make_key_pair
from tests.fake_stripe import signature as stripe_signature
from tests.raw_http import Answer, Reader, connect
from tests.support import (
    ADMIN_TOKEN,
    ADMISSION_SECRET,
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    base_env,
    create_deal,
    running_gate,
    token,
)

pytestmark = pytest.mark.slow

# Bad bytes, each spliced into every header value several ways (`_mutations`).
JUNK = (b"\xe9\xff", b"\x80\x85\xa0", b"\x01\x1f", b"\x7f")
LONG_BYTES = 16_000  # past every header's own bound, within the 32 KiB head bound

# What a bad value of each header is answered (the route's documented problem):
# the statuses allowed, and whether the answer may instead be the one the same
# request gets with the valid value (a header the gate only consults, or one a
# route does not read).
SAME = True


@dataclass(frozen=True)
class Expected:
    statuses: frozenset[int]
    same_allowed: bool = False
    code: dict[int, str] = field(default_factory=dict)


def _expect(*statuses: int, same: bool = False, **codes: str) -> Expected:
    return Expected(frozenset(statuses), same, {int(k[1:]): v for k, v in codes.items()})


EXPECTED: dict[str, Expected] = {
    "authorization": _expect(401, s401="UNAUTHORIZED"),
    "idempotency-key": _expect(400, s400="INVALID_REQUEST"),
    # 403 ADMISSION_INVALID (on a deal with a room); 400 past its 200-character bound.
    "admission-token": _expect(400, 403, s403="ADMISSION_INVALID", s400="INVALID_REQUEST"),
    "x-device-id": _expect(400, s400="INVALID_REQUEST"),
    # A webhook reads no Content-Type (its verifier judges the body).
    "content-type": _expect(400, 415, same=SAME),
    # Framing: the HTTP parser's 400, or the route's 413 for a length past its bound.
    "content-length": _expect(400, 413),
    "cookie": _expect(401, s401="UNAUTHORIZED"),
    "x-csrf-token": _expect(403, s403="FORBIDDEN"),
    "x-forwarded-for": _expect(same=SAME),
    "x-request-id": _expect(same=SAME),
    # Webhook signatures: 401 (rejected, counted as such), 400 when unreadable.
    "webhook-id": _expect(401, 400),
    "webhook-timestamp": _expect(401, 400),
    "webhook-signature": _expect(401, 400),
    "stripe-signature": _expect(401, 400),
    "wechatpay-timestamp": _expect(401, 400),
    "wechatpay-nonce": _expect(401, 400),
    "wechatpay-signature": _expect(401, 400),
    # The serial names the platform key; a wrong one finds none (401) or, with one
    # key configured, is not consulted.
    "wechatpay-serial": _expect(401, 400, same=SAME),
}

RESERVE = ("POST", "/v1/deals/{deal_id}/reservations")
WEBHOOK = ("POST", "/v1/payments/{provider}/webhook")
# Headers a route reads that its OpenAPI operation does not name.
EXTRA_HEADERS: dict[tuple[str, str], tuple[str, ...]] = {
    RESERVE: ("x-device-id", "x-forwarded-for"),
}
# Read on every route (the request id is taken or made by the edge and middleware).
EVERY_ROUTE = ("x-request-id",)
# The console (not in the OpenAPI document): its routes and the headers each reads.
CONSOLE_ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("POST", "/console/api/session"): ("content-type", "content-length"),
    ("GET", "/console/api/session"): ("cookie",),
    ("DELETE", "/console/api/session"): ("cookie", "x-csrf-token"),
    ("GET", "/console/api/snapshot"): ("cookie",),
    ("GET", "/console/api/deals/{deal_id}/ledger"): ("cookie",),
    ("GET", "/console/api/deals/{deal_id}/advice"): ("cookie",),
    ("POST", "/console/api/deals/{deal_id}/{action}"): ("cookie", "x-csrf-token"),
    ("POST", "/console/api/panels/{panel}/{action}"): ("cookie", "x-csrf-token"),
}
# Routes that read no header of the request's (pages and files).
NO_HEADERS = {("GET", "/console"), ("GET", "/console/static/{name}")}
# A valid request with a bad X-Request-Id would sign the session out for the
# requests after it; the route's other headers are covered.
SIGN_OUT = ("DELETE", "/console/api/session")
# Headers that prove who sent the request: a valid request gets past them (not 401).
AUTHENTICATING = {
    "authorization",
    "cookie",
    "webhook-signature",
    "stripe-signature",
    "wechatpay-signature",
}
NOT_REPEATABLE = {(SIGN_OUT, "x-request-id")}
PROVIDER_HEADERS = {
    "stripe": StripeWebhook.header_names,
    "wechatpay": WechatPayWebhook.header_names,
    "alipay": AlipayWebhook.header_names,
}

TOKENS = AdmissionTokens(Secret(ADMISSION_SECRET))
STRIPE_KEY = "sk_test_fake0123456789abcdefghij"
STRIPE_SECRET = "whsec_fakeStripeEndpointSecret0123456789"
WECHAT_APIV3_KEY = "a7cde1ZJB1kG2e7VfTs3jQzaWizur8Gb"
WECHAT_SERIAL = "5157F09EFDC096DE15EBE81A47057A72"


def _mutations(clean: bytes) -> Iterator[tuple[str, bytes]]:
    for junk in JUNK:
        yield f"only {junk!r}", junk
        yield f"appended {junk!r}", clean + junk
        if len(clean) > 2:
            # The tail (a token's or a signature's last characters) replaced.
            yield f"tail {junk!r}", clean[:-2] + junk[:2].ljust(2, junk[:1])
            middle = len(clean) // 2
            yield f"middle {junk!r}", clean[:middle] + junk + clean[middle + 1 :]
    yield "long", clean + b"A" * LONG_BYTES
    yield "long non-ASCII", b"\xe9" * LONG_BYTES


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, bytes]
    body: bytes = b""


def send(port: int, call: Call) -> Answer:
    lines = [f"{call.method} {call.path} HTTP/1.1".encode(), b"host: 127.0.0.1"]
    lines.append(b"connection: close")
    if (call.body or call.method != "GET") and "content-length" not in call.headers:
        lines.append(b"content-length: %d" % len(call.body))
    lines += [name.encode() + b": " + value for name, value in call.headers.items()]
    with connect(port) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + call.body)
        return Reader(sock).answer()


def _parser_refusal(answer: Answer, value: bytes) -> bool:
    """The HTTP parser's own 400: a control byte it does not let through."""
    return (
        answer.status == 400
        and any(b < 0x20 or b == 0x7F for b in value)
        and str(answer.problem()["detail"]).startswith("Malformed HTTP request")
    )


def _healthy(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200


@dataclass
class Stack:
    """What one gate's routes need: their path values and their valid headers."""

    gate: GateProcess
    deal_id: int = 0
    provider: str = "sandbox"
    users: Iterator[int] = field(default_factory=lambda: itertools.count(8_000_001))
    keys: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    cookie: str = ""
    csrf: str = ""
    webhook: Callable[[], tuple[dict[str, str], bytes]] | None = None

    def call(self, method: str, template: str, op: dict[str, Any] | None) -> Call:
        """A valid request of the route, with fresh values (a new buyer, a new key)."""
        user = next(self.users)
        n = next(self.keys)
        path = (
            template.replace("{deal_id}", str(self.deal_id))
            .replace("{order_id}", new_id())
            .replace("{provider}", self.provider)
            .replace("{panel}", "webhooks")
            .replace("{action}", "no-such-action")
        )
        scheme = next(iter((op or {}).get("security", [{}])[0]), None) if op else None
        bearer = ADMIN_TOKEN if scheme == "admin" else token(user)
        expires_ms = int(time.time() * 1000) + 600_000
        admission = AdmissionTokens(Secret(ADMISSION_SECRET)).mint(
            self.deal_id, user, 1, expires_ms
        )
        headers = {
            "authorization": f"Bearer {bearer}",
            "idempotency-key": f"header-bytes-{n:08d}",
            "admission-token": admission,
            "x-device-id": f"device-{n}",
            "x-forwarded-for": "203.0.113.7",
            "x-request-id": f"header-bytes-{n}",
            "content-type": "application/json",
            "cookie": f"gate_console={self.cookie}",
            "x-csrf-token": self.csrf,
        }
        body = b'{"quantity": 1}' if (method, template) == RESERVE else b"{}"
        if (method, template) == WEBHOOK and self.webhook is not None:
            signed, body = self.webhook()
            headers.update({k.lower(): v for k, v in signed.items()})
        if method == "GET":
            body = b""
        else:
            headers["content-length"] = str(len(body))
        return Call(method, path, {k: v.encode("latin-1") for k, v in headers.items()}, body)


def routes_and_headers(
    doc: dict[str, Any], webhook_headers: tuple[str, ...] | None = None
) -> list[tuple[str, str, dict[str, Any] | None, tuple[str, ...]]]:
    """Every operation of the document with the headers it reads, then the console's."""
    params = doc.get("components", {}).get("parameters", {})
    found: list[tuple[str, str, dict[str, Any] | None, tuple[str, ...]]] = []
    for template, operations in sorted(doc["paths"].items()):
        for method, op in operations.items():
            if not isinstance(op, dict) or method.upper() not in (
                "GET",
                "POST",
                "PUT",
                "PATCH",
                "DELETE",
            ):
                continue
            key = (method.upper(), template)
            names: list[str] = []
            if op.get("security"):
                names.append("authorization")
            for param in op.get("parameters", []):
                if "$ref" in param:
                    param = params[param["$ref"].rsplit("/", 1)[1]]
                if param["in"] == "header":
                    names.append(param["name"].lower())
            if key == WEBHOOK and webhook_headers is not None:
                names = list(webhook_headers)
            if "requestBody" in op:
                names += ("content-type", "content-length")
            names += EXTRA_HEADERS.get(key, ())
            names += EVERY_ROUTE
            found.append((*key, op, tuple(dict.fromkeys(names))))
    for (method, template), names in CONSOLE_ROUTES.items():
        found.append((method, template, None, (*names, *EVERY_ROUTE)))
    return found


def check_route(stack: Stack, method: str, template: str, op: Any, names: tuple[str, ...]) -> int:
    """Every header of one route, every bad value; the requests sent."""
    port = stack.gate.port
    sent = 0
    if (method, template) != SIGN_OUT and AUTHENTICATING & set(names):
        # The valid request gets past every header check (it is authenticated, its
        # webhook signature verifies), so a bad value is what a refusal is about.
        clean = send(port, stack.call(method, template, op))
        assert clean.status < 500 and clean.status != 401, (method, template, clean)
    for name in names:
        if ((method, template), name) in NOT_REPEATABLE:
            continue
        expected = EXPECTED[name]
        for i in itertools.count():
            # A fresh valid request each time; its own value of the header spoiled (a
            # token keeps naming the request's buyer: only its bytes are wrong).
            call = stack.call(method, template, op)
            mutation = next(itertools.islice(_mutations(call.headers[name]), i, None), None)
            if mutation is None:
                break
            label, value = mutation
            call.headers[name] = value
            got = send(port, call)
            where = f"{method} {template} {name}: {label}"
            assert got.status < 500, (where, got)
            if got.status >= 400:
                doc = got.problem()
                assert got.headers["x-request-id"].isascii(), where
            if _parser_refusal(got, value):
                continue
            if got.status in expected.statuses:
                code = expected.code.get(got.status)
                assert code is None or doc["code"] == code, (where, doc)
                if got.status == 401 and template == WEBHOOK[1]:
                    # Through the endpoint's rejection: counted as a rejected webhook.
                    assert str(doc["detail"]).startswith("Webhook rejected"), (where, doc)
            else:
                assert expected.same_allowed, (where, got.status, got.body[:300])
                clean = send(port, stack.call(method, template, op))
                assert got.status == clean.status, (where, got, clean)
            sent += 1
    _healthy(port)
    return sent


def _served_routes(env: dict[str, str]) -> set[tuple[str, str]]:
    """The (method, path) pairs the app routes, from the app itself (no I/O)."""
    app = build_app(load_settings(env), background=False)
    served = set()
    for route in app.routes:
        if isinstance(route, Route):
            path = route.path.replace(":id}", "}").replace(":str}", "}")
            for method in route.methods or ():
                if method != "HEAD":
                    served.add((method, path))
    return served


def _gate(env: dict[str, str]) -> Iterator[GateProcess]:
    with running_gate(env, workers=1, background=False) as gate:
        yield gate


@pytest.fixture(scope="module")
def main_env(prepared: None) -> dict[str, str]:
    return {
        **base_env(),
        "GATE_TRUSTED_PROXIES": "127.0.0.1",
        "GATE_CONSOLE": "1",
    }


@pytest.fixture(scope="module")
def main_gate(main_env: dict[str, str]) -> Iterator[GateProcess]:
    yield from _gate(main_env)


def _sandbox_webhook() -> tuple[dict[str, str], bytes]:
    event = f"evt_hdr_{new_id()}"
    body = orjson.dumps({"id": event, "type": "ping", "created": int(time.time()), "data": {}})
    key = decode_secret(WEBHOOK_SECRET)
    return sign_headers([key], event, int(time.time()), body), body


async def test_every_header_of_every_route_takes_any_bytes(
    main_gate: GateProcess, main_env: dict[str, str]
) -> None:
    client = Client(main_gate.url)
    try:
        deal_id = await create_deal(client, stock=50, waiting_room={"admit_per_second": 10})
        signed_in = await client.post("/console/api/session", json={"token": ADMIN_TOKEN})
        assert signed_in.status_code == 200, signed_in.text
        cookie = signed_in.headers["Set-Cookie"].split(";", 1)[0].split("=", 1)[1]
        doc = (await client.get("/openapi.json")).json()
    finally:
        await client.close()
    stack = Stack(
        main_gate,
        deal_id=deal_id,
        cookie=cookie,
        csrf=str(signed_in.json()["csrf_token"]),
        webhook=_sandbox_webhook,
    )
    table = routes_and_headers(doc)
    covered = {(m, t) for m, t, _, _ in table}
    # Every route the app serves is generated from the document or in a table here.
    missing = _served_routes(main_env) - covered - NO_HEADERS
    assert not missing, f"routes without a header table entry: {sorted(missing)}"
    assert RESERVE in covered and ("POST", "/v1/deals/{deal_id}/queue") in covered
    sent = 0
    for method, template, op, names in table:
        sent += check_route(stack, method, template, op, names)
    assert sent > 500, sent
    log = main_gate.output()
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


def _stripe_env() -> dict[str, str]:
    return {
        "GATE_PAYMENT_PROVIDER": "stripe",
        "GATE_STRIPE_API_KEY": STRIPE_KEY,
        "GATE_STRIPE_WEBHOOK_SECRET": STRIPE_SECRET,
        "GATE_STRIPE_API_BASE": "http://127.0.0.1:9",
    }


def _stripe_webhook() -> tuple[dict[str, str], bytes]:
    now = int(time.time())
    body = orjson.dumps(
        {
            "id": f"evt_hdr{new_id()}",
            "object": "event",
            "type": "customer.created",
            "created": now,
            "data": {"object": {}},
        }
    )
    return {"Stripe-Signature": stripe_signature(STRIPE_SECRET, now, body)}, body


def _wechat_env(keys: dict[str, KeyPair]) -> dict[str, str]:
    return {
        "GATE_PAYMENT_PROVIDER": "wechatpay",
        "GATE_WECHATPAY_MCHID": "1900009191",
        "GATE_WECHATPAY_APPID": "wxd678efh567hg6787",
        "GATE_WECHATPAY_APIV3_KEY": WECHAT_APIV3_KEY,
        "GATE_WECHATPAY_PRIVATE_KEY_FILE": keys["merchant"].private_file,
        "GATE_WECHATPAY_CERT_SERIAL": "1DDE55AD98ED71D6EDD4A4A16996DE7B47773A8C",
        "GATE_WECHATPAY_PLATFORM_PUBLIC_KEY_FILE": keys["platform"].public_file,
        "GATE_WECHATPAY_API_BASE": "http://127.0.0.1:9",
    }


def _wechat_webhook(keys: dict[str, KeyPair]) -> Callable[[], tuple[dict[str, str], bytes]]:
    def make() -> tuple[dict[str, str], bytes]:
        body = b'{"id": "EV-header-bytes"}'
        ts, nonce = str(int(time.time())), "5K8264ILTKCH16CQ2502SI8ZNMTM67VS"
        return {
            "wechatpay-timestamp": ts,
            "wechatpay-nonce": nonce,
            "wechatpay-signature": sign_sha256_rsa(
                keys["platform"].private, answer_message(ts, nonce, body)
            ),
            "wechatpay-serial": WECHAT_SERIAL,
        }, body

    return make


def _alipay_env(keys: dict[str, KeyPair]) -> dict[str, str]:
    return {
        "GATE_PAYMENT_PROVIDER": "alipay",
        "GATE_ALIPAY_APP_ID": "2021000000000001",
        "GATE_ALIPAY_PRIVATE_KEY_FILE": keys["merchant"].private_file,
        "GATE_ALIPAY_PUBLIC_KEY_FILE": keys["platform"].public_file,
        "GATE_ALIPAY_GATEWAY_URL": "http://127.0.0.1:9/gateway.do",
    }


@pytest.mark.parametrize("provider", ["stripe", "wechatpay", "alipay"])
async def test_every_webhook_header_takes_any_bytes(
    provider: str, prepared: None, tmp_path: Path
) -> None:
    """The webhook route under each provider, with the headers its verifier reads:
    a bad signature header is a rejected webhook (401, or 400), never a 500."""
    keys = {name: make_key_pair(tmp_path, name) for name in ("merchant", "platform")}
    env = base_env()
    # The providers' test doubles speak plain http, which a gate accepts only in dev.
    env.pop("GATE_PAYMENT_PROVIDER_URL", None)
    env.update(
        {
            "GATE_ENV": "dev",
            "GATE_CONSOLE": "0",
            "GATE_PAYMENT_CALLBACK_URL": f"http://127.0.0.1:9/v1/payments/{provider}/webhook",
        }
    )
    webhook: Callable[[], tuple[dict[str, str], bytes]] | None = None
    if provider == "stripe":
        env.update(_stripe_env())
        webhook = _stripe_webhook
    elif provider == "wechatpay":
        env.update(_wechat_env(keys))
        webhook = _wechat_webhook(keys)
    else:
        env.update(_alipay_env(keys))
    for gate in _gate(env):
        client = Client(gate.url)
        try:
            doc = (await client.get("/openapi.json")).json()
        finally:
            await client.close()
        stack = Stack(gate, provider=provider, webhook=webhook)
        table = [
            row
            for row in routes_and_headers(doc, PROVIDER_HEADERS[provider])
            if (row[0], row[1]) == WEBHOOK
        ]
        assert len(table) == 1
        method, template, op, names = table[0]
        assert set(PROVIDER_HEADERS[provider]) <= set(names)
        assert check_route(stack, method, template, op, names) > 10
        log = gate.output()
        assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


def test_a_scope_id_in_x_forwarded_for_is_not_an_address_of_its_own() -> None:
    """An IPv6 scope id is free text (any bytes): every spelling would otherwise be an
    IP limiter key of its own. Such a hop counts as the proxy that sent it."""
    trusted = parse_networks("GATE_TRUSTED_PROXIES", "127.0.0.1")
    for hop in ("fe80::1%\xe9\xff", "fe80::1%eth0", "2001:db8::1%1"):
        assert client_ip("127.0.0.1", f"198.51.100.1, {hop}", trusted, 128) == "127.0.0.1"
    assert client_ip("127.0.0.1", "2001:db8::1", trusted, 128) == "2001:db8::1"
    assert client_ip("127.0.0.1", "198.51.100.1\xe9", trusted, 128) == "127.0.0.1"
