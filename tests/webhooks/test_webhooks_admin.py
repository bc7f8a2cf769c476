"""The webhook endpoints' admin API on a real gate: the lifecycle, and every bad input
answered 4xx problem+json with nothing changed (refused URLs included)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gate.store.db import Database
from tests.support import ADMIN, Client, GateProcess
from tests.webhooks_support import (
    Receiver,
    create_endpoint,
    no_endpoints_left,
    wait_for,
    webhook_env,
)

BASE = "/v1/admin/webhook-endpoints"
MISSING = "01JD3W9K2XG5W7Q8M4Z6V1R0TB"
pytestmark = pytest.mark.usefixtures("no_endpoints_left")
__all__ = ["no_endpoints_left"]


@pytest.fixture(scope="module")
def hook_gate(prepared: None) -> Iterator[GateProcess]:
    with GateProcess(webhook_env(GATE_WEBHOOK_MAX_ENDPOINTS="4"), workers=1) as proc:
        yield proc


@pytest.fixture
async def admin(hook_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(hook_gate.url) as c:
        try:
            yield c
        finally:
            for e in (await c.get(BASE, headers=ADMIN)).json()["endpoints"]:
                await c.request("DELETE", f"{BASE}/{e['id']}", headers=ADMIN)


async def _rows(db: Database) -> tuple[Any, ...]:
    row = await db.fetchone(
        "SELECT (SELECT COUNT(*) FROM webhook_endpoints WHERE status <> 'deleted'),"
        " (SELECT COALESCE(SUM(CRC32(CONCAT(url, events, description, status))), 0)"
        " FROM webhook_endpoints), (SELECT COUNT(*) FROM webhook_deliveries)"
    )
    assert row is not None
    return tuple(row)


def _problem(r: Any, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == status and body["code"] == code, body


async def test_lifecycle_create_read_change_rotate_delete(admin: Client, db: Database) -> None:
    receiver = Receiver()
    await receiver.start()
    try:
        made = await create_endpoint(admin, receiver.url, ["order.paid"], description="ops")
        assert made["status"] == "enabled" and made["secret"].startswith("whsec_")
        one = f"{BASE}/{made['id']}"
        shown = (await admin.get(one, headers=ADMIN)).json()
        assert "secret" not in shown and shown["events"] == ["order.paid"]
        assert shown["stats"] == {"attempts_24h": 0, "delivered_24h": 0, "pending": 0, "failed": 0}
        listed = (await admin.get(BASE, headers=ADMIN)).json()["endpoints"]
        assert [e["id"] for e in listed] == [made["id"]] and "secret" not in listed[0]
        r = await admin.request(
            "PATCH", one, json={"events": ["*"], "status": "disabled"}, headers=ADMIN
        )
        assert r.status_code == 200 and r.json()["status"] == "disabled", r.text
        assert r.json()["disabled_reason"] == "manual"
        r = await admin.request("PATCH", one, json={"status": "enabled"}, headers=ADMIN)
        assert r.json()["status"] == "enabled" and r.json()["disabled_reason"] is None
        # A test event, then its delivery on the page with its attempt.
        assert (await admin.post(one + "/test", headers=ADMIN)).status_code == 202

        async def delivered() -> dict[str, Any] | None:
            page = (await admin.get(one + "/deliveries?status=delivered", headers=ADMIN)).json()
            return page if page["deliveries"] else None

        page = await wait_for(delivered, 15)
        # The endpoint takes every type ("*"): an order of an earlier test expiring
        # in the background may reach it too, so only the test event is counted.
        (delivery,) = [d for d in page["deliveries"] if d["type"] == "webhook.test"]
        assert delivery["attempts"][0]["http_status"] == 200
        assert page["next_after"] is None
        (test_id,) = {r.msg_id for r in receiver.received if r.event["type"] == "webhook.test"}

        def sent_times() -> int:
            return [r.msg_id for r in receiver.received].count(test_id)

        assert sent_times() == 1
        r = await admin.post(f"{one}/deliveries/{delivery['id']}/retry", headers=ADMIN)
        assert r.status_code == 202 and r.json() == {"id": delivery["id"], "status": "pending"}
        # Sent again under the same webhook-id.
        await wait_for(lambda: sent_times() == 2, 15)
        _problem(
            await admin.post(f"{one}/deliveries/999999/retry", headers=ADMIN), 404, "NOT_FOUND"
        )
        rotated = await admin.post(one + "/rotate-secret", headers=ADMIN)
        assert rotated.status_code == 200 and rotated.json()["secret"] != made["secret"]
        r = await admin.request("DELETE", one, headers=ADMIN)
        assert r.status_code == 204
        _problem(await admin.get(one, headers=ADMIN), 404, "WEBHOOK_ENDPOINT_NOT_FOUND")
        _problem(
            await admin.request("DELETE", one, headers=ADMIN), 404, "WEBHOOK_ENDPOINT_NOT_FOUND"
        )
    finally:
        await receiver.stop()


HOSTILE_URLS = [
    "https://127.0.0.3/hook",
    "https://[::1]/hook",
    "https://[::ffff:127.0.0.3]/hook",
    "https://169.254.169.254/latest/meta-data/",
    "https://10.0.0.1/hook",
    "https://192.168.0.10/hook",
    "https://[fd12::1]/hook",
    "https://0.0.0.0/hook",
    "https://2130706433/hook",
    "https://127.1/hook",
    "http://shop.example/hook",
    "gopher://shop.example/hook",
    "https://admin:pw@shop.example/hook",
    "https://no-such-host.invalid/hook",
    "http://127.0.0.2:8080/hook",  # loopback, but not the listed 127.0.0.1
]


@pytest.mark.parametrize("url", HOSTILE_URLS)
async def test_refused_urls_are_refused_at_create_and_change(
    admin: Client, db: Database, url: str
) -> None:
    before = await _rows(db)
    r = await admin.post(BASE, json={"url": url, "events": ["*"]}, headers=ADMIN)
    _problem(r, 400, "WEBHOOK_URL_REFUSED")
    assert await _rows(db) == before
    made = await create_endpoint(admin, "http://127.0.0.1:1/hook")
    r = await admin.request("PATCH", f"{BASE}/{made['id']}", json={"url": url}, headers=ADMIN)
    _problem(r, 400, "WEBHOOK_URL_REFUSED")
    shown = (await admin.get(f"{BASE}/{made['id']}", headers=ADMIN)).json()
    assert shown["url"] == "http://127.0.0.1:1/hook"


BAD_BODIES: list[tuple[Any, str]] = [
    ([], "INVALID_REQUEST"),
    ("text", "INVALID_REQUEST"),
    ({"events": ["*"]}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h"}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": []}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": "*"}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["order.nope"]}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*", "order.paid"]}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["order.paid", "order.paid"]}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": [1]}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*"] * 40}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*"], "description": 7}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*"], "description": "x" * 501}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*"], "description": "a\nb"}, "INVALID_REQUEST"),
    ({"url": "http://127.0.0.1:1/h", "events": ["*"], "secret": "mine"}, "INVALID_REQUEST"),
    ({"url": 5, "events": ["*"]}, "INVALID_REQUEST"),
    ({"url": "https://x.example/" + "x" * 2100, "events": ["*"]}, "WEBHOOK_URL_REFUSED"),
    ({"url": "x" * 5000, "events": ["*"]}, "PAYLOAD_TOO_LARGE"),
]


@pytest.mark.parametrize(("body", "code"), BAD_BODIES)
async def test_bad_bodies_are_4xx_and_change_nothing(
    admin: Client, db: Database, body: Any, code: str
) -> None:
    before = await _rows(db)
    r = await admin.post(BASE, json=body, headers=ADMIN)
    assert 400 <= r.status_code < 500 and r.json()["code"] == code, r.text
    assert await _rows(db) == before


async def test_other_bad_requests(admin: Client, db: Database) -> None:
    made = await create_endpoint(admin, "http://127.0.0.1:1/hook")
    one = f"{BASE}/{made['id']}"
    before = await _rows(db)
    _problem(await admin.get(BASE), 401, "UNAUTHORIZED")
    _problem(await admin.post(BASE, json={"url": "x", "events": ["*"]}), 401, "UNAUTHORIZED")
    for path in (f"{BASE}/{MISSING}", f"{BASE}/nope", f"{BASE}/{'9' * 4400}"):
        _problem(await admin.get(path, headers=ADMIN), 404, "WEBHOOK_ENDPOINT_NOT_FOUND")
        _problem(await admin.post(path + "/test", headers=ADMIN), 404, "WEBHOOK_ENDPOINT_NOT_FOUND")
    for patch in ({}, {"status": "gone"}, {"id": "X"}, {"events": []}, {"description": None}):
        r = await admin.request("PATCH", one, json=patch, headers=ADMIN)
        _problem(r, 400, "INVALID_REQUEST")
    for query in (
        "limit=0",
        "limit=101",
        "limit=-1",
        "limit=1.5",
        f"limit={'9' * 4400}",
        "after=0",
        f"after={2**63}",
        "status=lost",
        "cursor=5",
    ):
        r = await admin.get(f"{one}/deliveries?{query}", headers=ADMIN)
        _problem(r, 400, "INVALID_REQUEST")
    r = await admin.post(f"{one}/deliveries/{'9' * 4400}/retry", headers=ADMIN)
    assert r.status_code == 404
    _problem(await admin.request("PUT", one, json={}, headers=ADMIN), 405, "METHOD_NOT_ALLOWED")
    assert await _rows(db) == before


async def test_the_endpoint_limit_is_a_409(admin: Client, db: Database) -> None:
    for i in range(4):
        await create_endpoint(admin, f"http://127.0.0.1:1/hook{i}")
    before = await _rows(db)
    r = await admin.post(BASE, json={"url": "http://127.0.0.1:1/x", "events": ["*"]}, headers=ADMIN)
    _problem(r, 409, "CONFLICT")
    assert "GATE_WEBHOOK_MAX_ENDPOINTS" in r.json()["detail"]
    assert await _rows(db) == before
    # A deleted endpoint frees its place.
    first = (await admin.get(BASE, headers=ADMIN)).json()["endpoints"][0]
    assert (
        await admin.request("DELETE", f"{BASE}/{first['id']}", headers=ADMIN)
    ).status_code == 204
    await create_endpoint(admin, "http://127.0.0.1:1/again")
