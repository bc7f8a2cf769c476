"""Payment test helpers: a real sandbox process, a gate wired to it, signed webhooks.

Fixtures are defined here and imported by the payment test modules (the shared
conftest belongs to the core). The gate here runs with two webhook secrets (OLD,
the suite's usual one, and NEW) to test rotation; the sandbox signs with NEW.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gate.base.settings import Settings
from gate.inventory import orders
from gate.payments.signing import decode_secret, sign_headers
from gate.runtime import Gate
from gate.store.db import Database
from tests.support import (
    GATE_BIN,
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    Resp,
    ServerProcess,
    base_env,
    buyer,
    free_port,
    reserve,
)

OLD_SECRET = WEBHOOK_SECRET
NEW_SECRET = "whsec_bmV3LXdlYmhvb2stc2VjcmV0LWZvci1yb3RhdGlvbi0wMQ=="
OTHER_SECRET = "whsec_c29tZWJvZHktZWxzZXMtc2VjcmV0LTAxMjM0NTY3ODk="
OLD_KEY = decode_secret(OLD_SECRET)
NEW_KEY = decode_secret(NEW_SECRET)
OTHER_KEY = decode_secret(OTHER_SECRET)
WEBHOOK_PATH = "/v1/payments/sandbox/webhook"
# The sandbox requires it on every route (but /pay and /healthz); the gate sends it as
# its provider API key, which it must have outside GATE_ENV=dev.
SANDBOX_API_KEY = "test-sandbox-api-key-0123456789"
SANDBOX_AUTH = {"Authorization": f"Bearer {SANDBOX_API_KEY}"}


def pay_env(sandbox_url: str) -> dict[str, str]:
    env = base_env()
    env.update(
        {
            # The sandbox speaks plain http, which a gate takes from its provider only
            # with GATE_ENV=dev (https without exception elsewhere). Its secrets
            # are still the test's own, set here and by base_env.
            "GATE_ENV": "dev",
            "GATE_WEBHOOK_SECRET": f"{OLD_SECRET} {NEW_SECRET}",
            # The database server is shared by parallel suites (max_connections).
            "GATE_DB_POOL_MAX": "16",
            "GATE_PAYMENT_PROVIDER_URL": sandbox_url,
            "GATE_PAYMENT_API_KEY": SANDBOX_API_KEY,
            "GATE_PAYMENT_TIMEOUT_SECONDS": "1",
            "GATE_PAYMENT_RETRY_MAX": "2",
            "GATE_PAYMENT_CAPTURE_MARGIN_SECONDS": "5",
            "GATE_PAYMENT_WORKER_INTERVAL_SECONDS": "0.2",
            "GATE_PAYMENT_RECOVERY_AFTER_SECONDS": "0.5",
            "GATE_PAYMENT_ACTION_LEASE_SECONDS": "1",
            "GATE_PAYMENT_BACKOFF_MAX_SECONDS": "2",
            "GATE_OUTBOX_INTERVAL_SECONDS": "0.2",
            "GATE_OUTBOX_STREAM": "gate:test-pay-events",
            # No background reconciliation: tests/payments/test_reconcile.py turns it on.
            "GATE_RECONCILE_INTERVAL_SECONDS": "0",
        }
    )
    return env


def sandbox_process(
    port: int, webhook_url: str, extra_env: dict[str, str] | None = None
) -> ServerProcess:
    """A real `gate sandbox` process: GATE_ENV=dev (it refuses anything else), its own
    webhook secret (NEW_SECRET, which the gate's GATE_WEBHOOK_SECRET lists) and an API
    key on every route."""
    env = base_env()
    env.update(
        {
            "GATE_ENV": "dev",
            "GATE_SANDBOX_API_KEY": SANDBOX_API_KEY,
            "GATE_SANDBOX_WEBHOOK_SECRET": NEW_SECRET,
            "GATE_SANDBOX_WEBHOOK_URL": webhook_url,
            "GATE_SANDBOX_BACKOFF_BASE_SECONDS": "0.1",
            "GATE_SANDBOX_BACKOFF_MAX_SECONDS": "0.5",
            **(extra_env or {}),
        }
    )
    return ServerProcess("sandbox", [GATE_BIN, "sandbox", "--port", str(port)], env, port)


@dataclass
class PayStack:
    gate: GateProcess
    sandbox: ServerProcess
    env: dict[str, str]


@contextmanager
def running_pay_stack(
    extra_env: dict[str, str] | None = None, provider: str = "sandbox", workers: int = 2
) -> Iterator[PayStack]:
    """A gate (`workers` processes) and a sandbox delivering to it, both stopped after."""
    sandbox_port = free_port()
    env = {**pay_env(f"http://127.0.0.1:{sandbox_port}"), **(extra_env or {})}
    webhook = f"/v1/payments/{provider}/webhook"
    with (
        GateProcess(env, workers=workers) as gate,
        sandbox_process(sandbox_port, gate.url + webhook) as sandbox,
    ):
        yield PayStack(gate, sandbox, env)


# Per module: no payment gate idles in the background while other suites run.
@pytest.fixture(scope="module")
def pay_stack(prepared: None) -> Iterator[PayStack]:
    with running_pay_stack() as stack:
        yield stack


@pytest.fixture
async def pay_client(pay_stack: PayStack) -> AsyncIterator[Client]:
    async with Client(pay_stack.gate.url) as c:
        yield c


class KeyedClient(Client):
    """A Client that sends the sandbox's API key unless the call names its own
    Authorization header."""

    async def request(
        self, method: str, path: str, *, headers: Mapping[str, str] | None = None, **kw: Any
    ) -> Resp:
        return await super().request(
            method, path, headers={**SANDBOX_AUTH, **(headers or {})}, **kw
        )


class SandboxClient:
    def __init__(self, url: str) -> None:
        self.http = KeyedClient(url)

    async def close(self) -> None:
        await self.http.close()

    async def _ok(self, method: str, path: str, body: Any = None) -> Any:
        r = await self.http.request(method, path, json=body)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    async def configure(self, **controls: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self._ok("POST", "/sandbox/config", controls)
        return result

    async def reset(self) -> None:
        await self.configure(
            mode="auto",
            duplicates=0,
            delay_seconds=0.0,
            reorder_window_seconds=0.0,
            drop_rate=0.0,
            refund_mode="succeed",
            session_delay_seconds=0.0,
        )

    async def pay(self, session_id: str, outcome: str = "succeed") -> dict[str, Any]:
        result: dict[str, Any] = await self._ok("POST", f"/pay/{session_id}", {"outcome": outcome})
        return result

    async def events(self, order_id: str, event_type: str | None = None) -> list[dict[str, Any]]:
        path = f"/sandbox/events?order_id={order_id}"
        if event_type:
            path += f"&type={event_type}"
        doc = await self._ok("GET", path)
        return list(doc["data"])

    async def deliver(
        self, event_ids: list[str], copies: int = 1, concurrent: bool = False
    ) -> list[list[int]]:
        doc = await self._ok(
            "POST",
            "/sandbox/deliver",
            {"event_ids": event_ids, "copies": copies, "concurrent": concurrent},
        )
        return list(doc["statuses"])

    async def payments(self, order_id: str) -> list[dict[str, Any]]:
        doc = await self._ok("GET", f"/v1/payments?order_id={order_id}")
        return list(doc["data"])

    async def transactions(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor = "0"
        while cursor is not None:
            doc = await self._ok("GET", f"/v1/transactions?after={cursor}&limit=1000")
            items.extend(doc["data"])
            cursor = doc["next"]
        return items

    async def refunds_of(self, payment_id: str) -> list[dict[str, Any]]:
        return [
            t
            for t in await self.transactions()
            if t["kind"] == "refund" and t["payment_id"] == payment_id
        ]


@pytest.fixture
async def sandbox(pay_stack: PayStack) -> AsyncIterator[SandboxClient]:
    sb = SandboxClient(pay_stack.sandbox.url)
    await sb.reset()
    try:
        yield sb
    finally:
        await sb.reset()
        await sb.close()


@pytest.fixture(scope="session")
async def core(settings: Settings, prepared: None) -> AsyncIterator[Gate]:
    """The gate's services in the test process (no HTTP, no background loops): what
    the expiry sweeper would use to release a hold."""
    g = Gate(settings)
    await g.db.start()
    await g.runner.load()
    try:
        yield g
    finally:
        await g.stop()


# -- orders ---------------------------------------------------------------------------


async def new_order(client: Client, deal_id: int, user_id: int, quantity: int = 1) -> str:
    r = await reserve(client, deal_id, user_id, f"pay-{deal_id}-{user_id}-{quantity}", quantity)
    assert r.status_code == 201, r.text
    return str(r.json()["order_id"])


async def start_payment(client: Client, order_id: str, user_id: int) -> dict[str, Any]:
    r = await client.post(f"/v1/orders/{order_id}/payment", headers=buyer(user_id))
    assert r.status_code in (200, 201), r.text
    body: dict[str, Any] = r.json()
    return body


async def order_row(db: Database, order_id: str) -> dict[str, Any]:
    row = await db.fetchone(
        "SELECT status, paid_amount, refunded_amount, provider_payment_id, alloc, amount"
        " FROM orders WHERE id = %s",
        (order_id,),
    )
    assert row is not None
    return {
        "status": row[0],
        "paid_amount": int(row[1]),
        "refunded_amount": int(row[2]),
        "payment_id": row[3],
        "alloc": row[4],
        "amount": int(row[5]),
    }


async def wait_status(
    db: Database, order_id: str, status: str, timeout_seconds: float = 15.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_seconds
    row = await order_row(db, order_id)
    while row["status"] != status and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        row = await order_row(db, order_id)
    assert row["status"] == status, row
    return row


async def wait_until(predicate: Any, timeout_seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = await predicate()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def reconcile(env: Mapping[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    """`gate reconcile --json ARGS…` as an operator runs it; its exit status and report."""
    proc = await asyncio.create_subprocess_exec(
        GATE_BIN,
        "reconcile",
        "--json",
        *args,
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    assert out, err.decode()[-3000:]
    report: dict[str, Any] = orjson.loads(out)
    return proc.returncode, report


async def expire(core: Gate, order_id: str) -> None:
    """End a hold the way the expiry sweeper does: past the deadline, then a
    conditional release that may take an AUTHORIZED order too (or the gate's own
    sweeper, which may win the race, does it)."""
    await core.db.execute(
        "UPDATE orders SET expires_at = NOW(6) - INTERVAL 1 SECOND WHERE id = %s", (order_id,)
    )
    order = await orders.get(core.db, order_id)
    assert order is not None
    released = await orders.release(
        core.db,
        core.mirror,
        order,
        to_status="EXPIRED",
        user_id=None,
        due_only=True,
        allow_authorized=True,
        reason="expire",
        actor="test-sweeper",
    )
    if not released:
        # The gate's own sweeper got there first (the hold was due): same outcome.
        after = await orders.get(core.db, order_id)
        assert after is not None and after.status == "EXPIRED", after


async def counts(db: Database, order_id: str) -> dict[str, int]:
    """What a callback may have changed for one order."""
    queries = {
        "events": "SELECT COUNT(*) FROM payment_events WHERE order_id = %s",
        "outbox": "SELECT COUNT(*) FROM outbox WHERE aggregate_id = %s",
        "ledger": "SELECT COUNT(*) FROM inventory_ledger WHERE order_id = %s",
        "refunds": "SELECT COUNT(*) FROM payment_refunds WHERE order_id = %s",
        "payments": "SELECT COUNT(*) FROM payments WHERE order_id = %s",
        "version": "SELECT version FROM orders WHERE id = %s",
    }
    out = {}
    for name, sql in queries.items():
        row = await db.fetchone(sql, (order_id,))
        out[name] = int(row[0]) if row else 0
    return out


# -- webhooks -------------------------------------------------------------------------


def event_body(
    event_type: str,
    order_id: str,
    payment_id: str,
    amount: int,
    currency: str = "EUR",
    *,
    event_id: str | None = None,
    refund_id: str | None = None,
) -> bytes:
    data: dict[str, Any] = {
        "payment_id": payment_id,
        "order_id": order_id,
        "amount": amount,
        "currency": currency,
    }
    if refund_id:
        data["refund_id"] = refund_id
    return orjson.dumps(
        {
            "id": event_id or f"evt_test_{os.urandom(8).hex()}",
            "type": event_type,
            "created": int(time.time()),
            "data": data,
        }
    )


def signed(
    body: bytes, key: bytes = NEW_KEY, *, msg_id: str | None = None, timestamp: int | None = None
) -> dict[str, str]:
    mid = msg_id or str(orjson.loads(body)["id"])
    headers = sign_headers([key], mid, int(time.time()) if timestamp is None else timestamp, body)
    headers["Content-Type"] = "application/json"
    return headers


async def post_webhook(client: Client, body: bytes, headers: dict[str, str]) -> Any:
    return await client.post(WEBHOOK_PATH, content=body, headers=headers)
