"""Receivers that misbehave, and faults of the gate's own: a hanging endpoint delays
neither another endpoint nor the sale; 410 disables; redirects are not followed;
big answers are cut; retries run out into `failed` and a retry resends; five days of
failures disable; a Redis flush loses nothing; queue mode's rejections are events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.metrics import METRICS
from gate.store.db import Database
from gate.webhooks.config import load_webhook_settings
from gate.webhooks.fanout import FanOut
from gate.webhooks.store import WebhookStore
from tests.support import ADMIN, Client, GateProcess, buyer, create_deal, reserve
from tests.webhooks_support import (
    Receiver,
    create_endpoint,
    no_endpoints_left,
    verify,
    wait_for,
    webhook_env,
)

BASE = "/v1/admin/webhook-endpoints"
pytestmark = pytest.mark.usefixtures("no_endpoints_left")
__all__ = ["no_endpoints_left"]


class Running:
    def __init__(self, **extra: str) -> None:
        self.proc = GateProcess(webhook_env(**extra), workers=1)
        self.proc.wait_ready()
        self.client = Client(self.proc.url)

    async def close(self) -> None:
        await self.client.close()
        self.proc.stop()


@pytest.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        await r.stop()


async def started(receivers: list[Receiver], policy: Any = None) -> Receiver:
    r = Receiver(policy) if policy else Receiver()
    await r.start()
    receivers.append(r)
    return r


async def test_a_hanging_endpoint_delays_neither_the_other_nor_the_sale(
    prepared: None, db: Database, receivers: list[Receiver]
) -> None:
    in_flight = [0, 0]  # now, most at once

    async def hang(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        try:
            await asyncio.sleep(30)
        finally:
            in_flight[0] -= 1
        return 200, {}, 0.0

    slow = await started(receivers, hang)
    fast = await started(receivers)
    # The dead endpoint's attempts hang for the whole test (the timeout is longer):
    # what the receiver holds at once is what the gate has in flight for it.
    gate = Running(
        GATE_WEBHOOK_ENDPOINT_CONCURRENCY="2",
        GATE_WEBHOOK_CONCURRENCY="8",
        GATE_WEBHOOK_RETRY_SCHEDULE="60",
        GATE_WEBHOOK_TIMEOUT_SECONDS="30",
    )
    try:
        dead = await create_endpoint(gate.client, slow.url)
        await create_endpoint(gate.client, fast.url)
        deal = await create_deal(gate.client, stock=40, buckets=2)
        orders = []
        for i in range(40):
            r = await reserve(gate.client, deal, 7000 + i, f"isolation-{deal}-{i}")
            assert r.status_code == 201, r.text  # the sale goes on
            orders.append((7000 + i, r.json()["order_id"]))
        for user, order_id in orders[:20]:
            r = await gate.client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
            assert r.status_code == 200, r.text
        cancelled = {o for _, o in orders[:20]}

        def all_there() -> bool:
            got = {
                r.event["data"].get("order_id")
                for r in fast.delivered().values()
                if r.event["type"] == "order.cancelled"
            }
            return got == cancelled

        await wait_for(all_there, 30, 0.1)
        # The dead endpoint held its own two slots, never more, and nothing else.
        assert in_flight[1] == 2 and slow.attempts and sum(slow.attempts.values()) == 2
        pending = await db.fetchone(
            "SELECT COUNT(*), COALESCE(SUM(claim IS NOT NULL), 0) FROM webhook_deliveries"
            " WHERE endpoint_id = %s AND status = 'pending'",
            (dead["id"],),
        )
        assert pending is not None and int(pending[0]) >= 20 and int(pending[1]) == 2
    finally:
        await gate.close()


async def test_gone_redirect_big_answers_and_retries_running_out(
    prepared: None, db: Database, receivers: list[Receiver]
) -> None:
    healthy = [False]

    async def gone(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return 410, {}, 0.0

    elsewhere = await started(receivers)

    async def redirect(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return 307, {"Location": elsewhere.url}, 0.0

    async def failing(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return (200 if healthy[0] else 500), {}, 0.0

    r_gone = await started(receivers, gone)
    r_redirect = await started(receivers, redirect)
    r_failing = await started(receivers, failing)
    gate = Running(GATE_WEBHOOK_RETRY_SCHEDULE="0.1,0.1")
    try:
        c = gate.client
        # A type no earlier test's background work makes: only the test events come.
        only = ["payment.quarantined"]
        e_gone = await create_endpoint(c, r_gone.url, only)
        e_redirect = await create_endpoint(c, r_redirect.url, only)
        e_failing = await create_endpoint(c, r_failing.url, only)
        for e in (e_gone, e_redirect, e_failing):
            assert (await c.post(f"{BASE}/{e['id']}/test", headers=ADMIN)).status_code == 202

        async def status_of(e: dict[str, Any]) -> dict[str, Any]:
            shown: dict[str, Any] = (await c.get(f"{BASE}/{e['id']}", headers=ADMIN)).json()
            return shown

        await wait_for(lambda: _disabled(status_of(e_gone)), 15)
        assert (await status_of(e_gone))["disabled_reason"] == "gone"

        async def failed(e: dict[str, Any]) -> list[dict[str, Any]]:
            page = await c.get(f"{BASE}/{e['id']}/deliveries?status=failed", headers=ADMIN)
            found: list[dict[str, Any]] = page.json()["deliveries"]
            return found

        (redirected,) = await wait_for(lambda: failed(e_redirect), 15)
        assert [a["http_status"] for a in redirected["attempts"]] == [307, 307, 307]
        assert "not followed" in redirected["attempts"][0]["error"]
        assert elsewhere.received == []  # the Location was never called
        (given_up,) = await wait_for(lambda: failed(e_failing), 15)
        assert len(given_up["attempts"]) == 3 and given_up["last_status"] == 500
        # Fixed, then retried by hand: one more attempt, delivered.
        healthy[0] = True
        r = await c.post(
            f"{BASE}/{e_failing['id']}/deliveries/{given_up['id']}/retry", headers=ADMIN
        )
        assert r.status_code == 202
        await wait_for(lambda: r_failing.delivered(), 15)
        assert r_failing.received[-1].msg_id == given_up["event_id"]
        verify(e_failing["secret"], r_failing.received[-1])
    finally:
        await gate.close()


async def _disabled(shown: Any) -> bool:
    return bool((await shown)["status"] == "disabled")


async def test_a_big_answer_is_read_up_to_its_bound(
    prepared: None, receivers: list[Receiver]
) -> None:
    from aiohttp import web

    big = b"x" * (2 * 1024 * 1024)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=200, body=big)

    app = web.Application()
    app.router.add_post("/hooks", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = Receiver().port
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gate = Running()
    try:
        e = await create_endpoint(gate.client, f"http://127.0.0.1:{port}/hooks")
        assert (await gate.client.post(f"{BASE}/{e['id']}/test", headers=ADMIN)).status_code == 202

        async def delivered() -> bool:
            page = await gate.client.get(f"{BASE}/{e['id']}/deliveries", headers=ADMIN)
            return bool(page.json()["deliveries"][0]["status"] == "delivered")

        await wait_for(delivered, 15)
    finally:
        await gate.close()
        await runner.cleanup()


async def test_five_days_of_failures_disable_an_endpoint(prepared: None, db: Database) -> None:
    settings = load_webhook_settings(webhook_env(), dev=False)
    store = WebhookStore(db)
    gate = Running(GATE_WEBHOOK_WORKERS="0")
    try:
        e = await create_endpoint(gate.client, "http://127.0.0.1:1/never")
        other = await create_endpoint(gate.client, "http://127.0.0.1:1/recent")
        await db.execute(
            "UPDATE webhook_endpoints SET failing_since = NOW(6) - INTERVAL 5 DAY - INTERVAL 1"
            " MINUTE WHERE id = %s",
            (e["id"],),
        )
        await db.execute(
            "UPDATE webhook_endpoints SET failing_since = NOW(6) - INTERVAL 2 HOUR WHERE id = %s",
            (other["id"],),
        )
        before = METRICS.registry.get_sample_value(
            "gate_webhook_endpoints_disabled_total", {"reason": "failing"}
        )
        await FanOut(store, settings, None).maintain()
        after = METRICS.registry.get_sample_value(
            "gate_webhook_endpoints_disabled_total", {"reason": "failing"}
        )
        assert (after or 0) - (before or 0) == 1
        assert METRICS.registry.get_sample_value("gate_webhook_endpoints_failing") == 1
        shown = (await gate.client.get(f"{BASE}/{e['id']}", headers=ADMIN)).json()
        assert (shown["status"], shown["disabled_reason"]) == ("disabled", "failing")
        kept = (await gate.client.get(f"{BASE}/{other['id']}", headers=ADMIN)).json()
        assert kept["status"] == "enabled"
        # Enabled again by a person: the clock starts over.
        r = await gate.client.request(
            "PATCH", f"{BASE}/{e['id']}", json={"status": "enabled"}, headers=ADMIN
        )
        assert r.json()["failing_since"] is None
        for x in (e, other):
            await gate.client.request("DELETE", f"{BASE}/{x['id']}", headers=ADMIN)
    finally:
        await gate.close()


async def test_a_redis_flush_mid_delivery_loses_nothing(
    prepared: None, db: Database, rds: aioredis.Redis, receivers: list[Receiver]
) -> None:
    async def refuse_first(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return (503 if attempt == 1 else 200), {}, 0.0

    receiver = await started(receivers, refuse_first)
    gate = Running(GATE_WEBHOOK_RETRY_SCHEDULE="1,1,1")
    try:
        await create_endpoint(gate.client, receiver.url, ["order.cancelled"])
        deal = await create_deal(gate.client, stock=10)
        orders = []
        for i in range(10):
            r = await reserve(gate.client, deal, 7100 + i, f"flush-{deal}-{i}")
            assert r.status_code == 201
            orders.append((7100 + i, r.json()["order_id"]))
        for user, order_id in orders:
            await gate.client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
        await wait_for(lambda: len(receiver.received) >= 1, 15, 0.05)
        await rds.flushdb()  # leases, the mirror: everything of Redis
        want = {o for _, o in orders}
        await wait_for(
            lambda: {r.event["data"]["order_id"] for r in receiver.delivered().values()} == want,
            30,
        )
    finally:
        await gate.close()


async def test_queue_mode_rejections_are_order_rejected_events(
    prepared: None, receivers: list[Receiver]
) -> None:
    """Orders cancelled while queued (this gate's consumers are off) are rejected when
    a consumer meets them: each an `order.rejected` event. (The suite's shared gate
    may run consumers too: an order it committed first is cancelled as an order, and
    its event is `order.cancelled`.)"""
    receiver = await started(receivers)
    waiting = Running(GATE_QUEUE_CONSUMERS="0")
    outcome: dict[str, str] = {}
    try:
        await create_endpoint(waiting.client, receiver.url, ["order.rejected", "order.cancelled"])
        deal = await create_deal(waiting.client, stock=3, mode="queue", unit_price=450)
        users = [7210, 7211, 7212]
        answers = [await reserve(waiting.client, deal, u, f"queued-{deal}-{u}") for u in users]
        assert [a.status_code for a in answers] == [202, 202, 202], [a.text for a in answers]
        queued = [str(a.json()["order_id"]) for a in answers]
        for user, order_id in zip(users[:2], queued[:2], strict=True):

            async def cancelled(user: int = user, order_id: str = order_id) -> Any:
                r = await waiting.client.post(f"/v1/orders/{order_id}/cancel", headers=buyer(user))
                return r if r.status_code == 200 else None  # 503: being committed

            outcome[order_id] = (await wait_for(cancelled, 20, 0.2)).json()["status"]
    finally:
        await waiting.close()
    gate = Running()
    try:

        def events() -> dict[str, dict[str, Any]]:
            got = receiver.delivered().values()
            return {r.event["data"]["order_id"]: r.event for r in got}

        await wait_for(lambda: set(events()) == set(outcome), 30)
        for order_id, status in outcome.items():
            event = events()[order_id]
            data = event["data"]
            assert status in ("REJECTED", "CANCELLED")
            assert event["type"] == (
                "order.rejected" if status == "REJECTED" else "order.cancelled"
            )
            assert data["status"] == status and data["sequence"] == 1
            assert (data["deal_id"], data["quantity"], data["amount"]) == (deal, 1, 450)
            assert data["currency"] == "EUR" and data["user_id"] in users[:2]
            if status == "REJECTED":
                assert data["reason"] == "CANCELLED"
    finally:
        await gate.close()


async def test_the_address_connected_to_is_checked_again_on_every_delivery(
    prepared: None, db: Database, receivers: list[Receiver]
) -> None:
    """A name accepted when it was set (listed then) that now leads to a refused
    address (here: no longer listed; in the wild: DNS rebinding) is never called: the
    gate resolves it, checks each address, and records the attempt as refused."""
    receiver = await started(receivers)
    url = f"https://localhost:{receiver.port}/hooks"
    listed = Running(GATE_WEBHOOK_ALLOWED_HOSTS="localhost", GATE_WEBHOOK_WORKERS="0")
    try:
        made = await create_endpoint(listed.client, url)
    finally:
        await listed.close()
    gate = Running(GATE_WEBHOOK_ALLOWED_HOSTS="", GATE_WEBHOOK_RETRY_SCHEDULE="30")
    try:
        r = await gate.client.post(f"{BASE}/{made['id']}/test", headers=ADMIN)
        assert r.status_code == 202

        async def refused() -> str | None:
            row = await db.fetchone(
                "SELECT a.error FROM webhook_attempts a JOIN webhook_deliveries d"
                " ON d.id = a.delivery_id WHERE d.endpoint_id = %s",
                (made["id"],),
            )
            return None if row is None else str(row[0])

        error = await wait_for(refused, 15)
        assert error.startswith("refused: localhost resolves to") and "loopback" in error
        assert receiver.received == []
        await gate.client.request("DELETE", f"{BASE}/{made['id']}", headers=ADMIN)
    finally:
        await gate.close()


async def test_an_orders_events_carry_increasing_sequences(
    prepared: None, receivers: list[Receiver]
) -> None:
    """An order that expires and is then paid late has two events, numbered 1 and 2 in
    the order they happened, whatever order they arrive in."""
    import time as clock

    from gate.payments.signing import decode_secret, sign_headers
    from tests.payments_support import event_body
    from tests.support import WEBHOOK_SECRET

    receiver = await started(receivers)
    gate = Running()
    try:
        await create_endpoint(
            gate.client, receiver.url, ["order.expired", "order.paid", "payment.refund_scheduled"]
        )
        deal = await create_deal(gate.client, stock=2, hold_seconds=1, unit_price=300)
        r = await reserve(gate.client, deal, 7300, f"sequence-{deal}-7300")
        order_id = r.json()["order_id"]

        def events() -> list[dict[str, Any]]:
            got = [x.event for x in receiver.delivered().values()]
            return sorted(
                (e for e in got if e["data"].get("order_id") == order_id),
                key=lambda e: e["data"]["sequence"],
            )

        await wait_for(lambda: [e["type"] for e in events()] == ["order.expired"], 20)
        body = event_body("payment.succeeded", order_id, f"pi_late_{order_id}", 300)
        key = decode_secret(WEBHOOK_SECRET)
        headers = sign_headers([key], f"msg_late_{order_id}", int(clock.time()), body)
        headers["Content-Type"] = "application/json"
        paid = await gate.client.post("/v1/payments/sandbox/webhook", content=body, headers=headers)
        assert paid.status_code == 200, paid.text
        await wait_for(lambda: len(events()) == 2, 20)
        first, second = events()
        assert first["type"] == "order.expired" and first["data"]["sequence"] == 1
        assert second["type"] in ("order.paid", "payment.refund_scheduled")
        assert second["data"]["sequence"] == 2 and second["data"]["payment"]["amount"] == 300
    finally:
        await gate.close()
