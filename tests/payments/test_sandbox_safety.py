"""The sandbox provider is fenced in: it starts only with GATE_ENV=dev, signs
with its own secret (never GATE_WEBHOOK_SECRET), wants its API key on every route but
the health probe and the buyer's page, sends callbacks only to allowed hosts (without
following redirects), and refuses controls of the wrong type without changing any.

Real `gate sandbox` processes and a real HTTP receiver for the callbacks."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from gate.base.settings import DEV_WEBHOOK_SECRET
from gate.payments.sandbox.server import build_sandbox_app, load_config
from gate.payments.signing import WebhookRejected, decode_secret, verify
from tests.payments_support import OTHER_SECRET, sandbox_process
from tests.support import GATE_BIN, Client, ServerProcess, base_env, free_port

KEY = "test-sandbox-key-for-safety-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Receiver:
    """A real HTTP endpoint that records what is posted to it."""

    host: str
    port: int = field(default_factory=free_port)
    redirect_to: str | None = None
    hits: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook"

    async def start(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            self.hits.append((dict(request.headers), await request.read()))
            if self.redirect_to:
                return web.Response(status=307, headers={"Location": self.redirect_to})
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/hook", hook)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def sandbox_cmd(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, "sandbox", "--port", str(free_port())],
        env={**base_env(), **extra},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_sandbox_starts_only_in_dev_and_checks_its_settings() -> None:
    for gate_env in ("production", "test", ""):
        out = sandbox_cmd({"GATE_ENV": gate_env})
        assert out.returncode == 2, (gate_env, out.stderr)
        assert "gate sandbox runs only with GATE_ENV=dev" in out.stderr
        assert "Traceback" not in out.stderr
    for extra, message in (
        (
            {"GATE_SANDBOX_WEBHOOK_URL": "http://10.1.2.3/v1/payments/sandbox/webhook"},
            "GATE_SANDBOX_WEBHOOK_URL",
        ),
        ({"GATE_SANDBOX_NOTIFY_ALLOW": "127.0.0.1 bad_host!"}, "GATE_SANDBOX_NOTIFY_ALLOW"),
        ({"GATE_SANDBOX_WEBHOOK_SECRET": "not-a-whsec"}, "GATE_SANDBOX_WEBHOOK_SECRET"),
    ):
        out = sandbox_cmd({"GATE_ENV": "dev", **extra})
        assert out.returncode == 2, (extra, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver("127.0.0.1")
    await r.start()
    try:
        yield r
    finally:
        await r.stop()


@pytest.fixture
def keyed_sandbox(receiver: Receiver) -> Iterator[ServerProcess]:
    # The gate's GATE_WEBHOOK_SECRET is set (OTHER_SECRET) and must not be used;
    # GATE_SANDBOX_WEBHOOK_SECRET is unset: the built-in dev secret signs.
    env = {
        "GATE_SANDBOX_API_KEY": KEY,
        "GATE_WEBHOOK_SECRET": OTHER_SECRET,
        "GATE_SANDBOX_WEBHOOK_SECRET": "",
        "GATE_SANDBOX_NOTIFY_ALLOW": "127.0.0.1",
    }
    with sandbox_process(free_port(), receiver.url, env) as proc:
        yield proc


async def wait_hits(receiver: Receiver, n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if len(receiver.hits) >= n:
            return
        await asyncio.sleep(0.05)


def route_probes() -> list[tuple[str, str]]:
    """(method, path) of every route of the sandbox app, with sample ids."""
    app = build_sandbox_app(load_config({"GATE_ENV": "dev"}, "127.0.0.1", 8090))
    probes = []
    for route in app.routes:
        path = str(route.path)  # type: ignore[attr-defined]
        for name in ("payment_id", "refund_id", "session_id"):
            path = path.replace("{" + name + "}", "x_123")
        for method in sorted(route.methods or ()):  # type: ignore[attr-defined]
            if method != "HEAD":
                probes.append((method, path))
    return probes


async def test_with_an_api_key_every_route_but_health_needs_it(
    keyed_sandbox: ServerProcess, receiver: Receiver
) -> None:
    client = Client(keyed_sandbox.url)
    try:
        probes = route_probes()
        assert ("POST", "/sandbox/config") in probes and ("POST", "/v1/sessions") in probes
        for method, path in probes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = await client.request(method, path, json={}, headers=headers)
                if path == "/healthz":
                    assert r.status_code != 401, (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert r.json()["status"] == 401 and "WWW-Authenticate" in r.headers
        # Nothing was changed by the refused calls.
        r = await client.get("/sandbox/stats", headers=AUTH)
        assert r.status_code == 200 and r.json()["sessions"] == 0

        # With the key, the flow works; the pay step moves money, so it wants the key too.
        session = await client.post(
            "/v1/sessions",
            json={"order_id": "o-1", "amount": 100, "currency": "EUR", "expires_at": 2**31},
            headers={**AUTH, "Idempotency-Key": "s-1"},
        )
        assert session.status_code == 200, session.text
        unpaid = await client.post(f"/pay/{session.json()['id']}", json={"outcome": "succeed"})
        assert unpaid.status_code == 401
        paid = await client.post(
            f"/pay/{session.json()['id']}", json={"outcome": "succeed"}, headers=AUTH
        )
        assert paid.status_code == 200 and paid.json()["status"] == "succeeded"
        await wait_hits(receiver, 1)
        assert len(receiver.hits) == 1
        headers, body = receiver.hits[0]
        # Signed with the dev secret, never with the gate's GATE_WEBHOOK_SECRET.
        dev_key, other_key = decode_secret(DEV_WEBHOOK_SECRET), decode_secret(OTHER_SECRET)
        lower = {k.lower(): v for k, v in headers.items()}
        assert verify([dev_key], lower, body, now=time.time())
        with pytest.raises(WebhookRejected, match="no signature matches"):
            verify([other_key], lower, body, now=time.time())
    finally:
        await client.close()
    log = keyed_sandbox.log_path.read_text()
    assert "GATE_SANDBOX_WEBHOOK_SECRET is unset" in log


async def test_callbacks_go_only_to_allowed_hosts_and_redirects_are_not_followed(
    keyed_sandbox: ServerProcess, receiver: Receiver
) -> None:
    elsewhere = Receiver("127.0.0.2")  # loopback, but not on this sandbox's allow-list
    await elsewhere.start()
    client = Client(keyed_sandbox.url)
    try:
        before = (await client.get("/sandbox/config", headers=AUTH)).json()
        for url in (
            elsewhere.url,
            "http://10.0.0.1/hook",
            "http://example.com/hook",
            "ftp://127.0.0.1/hook",
            "http://user@127.0.0.1/hook",
        ):
            r = await client.post("/sandbox/config", json={"webhook_url": url}, headers=AUTH)
            assert r.status_code == 400, (url, r.text)
            assert r.json()["code"] == "notify_url_not_allowed"
            assert r.headers["content-type"] == "application/problem+json"
            r = await client.post(
                "/v1/sessions",
                json={
                    "order_id": "o-deny",
                    "amount": 100,
                    "currency": "EUR",
                    "expires_at": 2**31,
                    "notify_url": url,
                },
                headers={**AUTH, "Idempotency-Key": f"deny-{url}"},
            )
            assert r.status_code == 400, (url, r.text)
            r = await client.post(
                "/sandbox/seed/payment",
                json={"order_id": "o-deny", "amount": 1, "currency": "EUR", "notify_url": url},
                headers=AUTH,
            )
            assert r.status_code == 400, (url, r.text)
        assert (await client.get("/sandbox/config", headers=AUTH)).json() == before
        listed = await client.get("/v1/sessions?order_id=o-deny", headers=AUTH)
        assert listed.json()["data"] == []
        assert (await client.get("/v1/payments?order_id=o-deny", headers=AUTH)).json()["data"] == []

        # An allowed target that redirects elsewhere: the sandbox does not follow.
        receiver.redirect_to = elsewhere.url
        r = await client.post(
            "/sandbox/seed/payment",
            json={"order_id": "o-redirect", "amount": 1, "currency": "EUR"},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        await wait_hits(receiver, 1)
        events = await client.get("/sandbox/events?order_id=o-redirect", headers=AUTH)
        assert receiver.hits and events.json()["data"][0]["last_status"] == 307
        assert elsewhere.hits == []
    finally:
        await client.close()
        await elsewhere.stop()


async def test_controls_of_the_wrong_type_are_refused_and_change_nothing(
    keyed_sandbox: ServerProcess,
) -> None:
    client = Client(keyed_sandbox.url)
    try:
        before = (await client.get("/sandbox/config", headers=AUTH)).json()
        bad: list[dict[str, Any]] = [
            {"duplicates": "3"},
            {"duplicates": True},
            {"duplicates": 2.5},
            {"duplicates": 101},
            {"drop_rate": "x"},
            {"drop_rate": 2},
            {"delay_seconds": []},
            {"delay_seconds": -1},
            {"reorder_window_seconds": {"a": 1}},
            {"session_delay_seconds": None},
            {"mode": 1},
            {"mode": "sometimes"},
            {"refund_mode": ["fail"]},
            {"webhook_url": 5},
            # One good control beside a bad one: neither is applied.
            {"mode": "hold", "duplicates": "2"},
            {"nonsense": 1},
        ]
        for doc in bad:
            r = await client.post("/sandbox/config", json=doc, headers=AUTH)
            assert r.status_code == 400, (doc, r.status_code, r.text)
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["status"] == 400 and r.json()["detail"]
        assert (await client.get("/sandbox/config", headers=AUTH)).json() == before
        for path, doc in (
            ("/sandbox/deliver", {"event_ids": "evt_1"}),
            ("/sandbox/deliver", {"event_ids": [1, 2]}),
            ("/sandbox/deliver", {"event_ids": ["evt_1"], "concurrent": "yes"}),
            ("/sandbox/deliver", {"event_ids": ["evt_1"], "copies": True}),
            (
                "/sandbox/seed/payment",
                {"order_id": "o-t", "amount": 1, "currency": "EUR", "emit": "no"},
            ),
            ("/sandbox/seed/payment", {"order_id": "o-t", "amount": "1", "currency": "EUR"}),
            (
                "/sandbox/seed/payment",
                {"order_id": "o-t", "amount": 1, "currency": "EUR", "status": 1},
            ),
            ("/sandbox/seed/refund", {"payment_id": "pi_x", "amount": 1, "force": "yes"}),
        ):
            r = await client.post(path, json=doc, headers=AUTH)
            assert r.status_code in (400, 404), (path, doc, r.status_code, r.text)
            if r.status_code == 400:
                assert r.headers["content-type"] == "application/problem+json"
        # Unknown routes and methods answer problem+json too.
        for method, path in (("GET", "/nope"), ("DELETE", "/sandbox/config")):
            r = await client.request(method, path, headers=AUTH)
            assert r.status_code in (404, 405), (method, path, r.status_code)
            assert r.headers["content-type"] == "application/problem+json"
        # The right types work.
        good = {"mode": "hold", "duplicates": 2, "drop_rate": 0, "delay_seconds": 0.5}
        r = await client.post("/sandbox/config", json=good, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["mode"] == "hold" and r.json()["duplicates"] == 2
        stats = (await client.get("/sandbox/stats", headers=AUTH)).json()
        assert stats["payments"] == 0
    finally:
        await client.close()


async def test_a_path_with_a_trailing_newline_matches_no_sandbox_route(
    keyed_sandbox: ServerProcess,
) -> None:
    """The sandbox's paths match exactly, as the gate's do: "$" also matched before a
    final newline, so "/sandbox/stats%0A" (percent-decoded) was /sandbox/stats."""
    client = Client(keyed_sandbox.url)
    try:
        r = await client.get("/sandbox/stats", headers=AUTH)
        assert r.status_code == 200 and r.json()["sessions"] == 0
        for method, path in (
            ("GET", "/sandbox/stats%0A"),
            ("GET", "/healthz%0A"),
            ("POST", "/v1/sessions%0A"),
            ("POST", "/v1/payments/x_123/capture%0A"),
        ):
            r = await client.request(
                method, path, json={}, headers={**AUTH, "Idempotency-Key": "nl-1"}
            )
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        # The refused session was not created.
        r = await client.get("/sandbox/stats", headers=AUTH)
        assert r.status_code == 200 and r.json()["sessions"] == 0
    finally:
        await client.close()
