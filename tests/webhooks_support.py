"""Webhook test helpers: a real HTTP receiver on loopback, a gate that may call it,
and the standardwebhooks library as the shop would verify with."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from standardwebhooks.webhooks import Webhook

from gate.store.db import Database
from tests.support import ADMIN, Client, base_env, free_port

# (webhook-id, attempt number at this receiver) -> (status, headers, seconds to wait)
Policy = Callable[[str, int], Awaitable[tuple[int, dict[str, str], float]]]


async def accept(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
    return 200, {}, 0.0


@dataclass
class Received:
    msg_id: str
    timestamp: str
    signature: str
    body: bytes
    status: int
    at: float
    headers: dict[str, str]

    @property
    def event(self) -> dict[str, Any]:
        parsed: dict[str, Any] = orjson.loads(self.body)
        return parsed


@dataclass
class Receiver:
    """An aiohttp server on 127.0.0.1 that answers each POST as `policy` says and
    records every request (what it answered too)."""

    policy: Policy = accept
    port: int = field(default_factory=free_port)
    received: list[Received] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        msg_id = request.headers.get("webhook-id", "")
        attempt = self.attempts.get(msg_id, 0) + 1
        self.attempts[msg_id] = attempt
        status, headers, wait = await self.policy(msg_id, attempt)
        if wait:
            await asyncio.sleep(wait)
        self.received.append(
            Received(
                msg_id,
                request.headers.get("webhook-timestamp", ""),
                request.headers.get("webhook-signature", ""),
                body,
                status,
                time.monotonic(),
                dict(request.headers),
            )
        )
        return web.Response(status=status, headers=headers, text="ok" if status < 300 else "no")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hooks", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def delivered(self) -> dict[str, Received]:
        """Each webhook-id's first 2xx-answered request."""
        out: dict[str, Received] = {}
        for r in self.received:
            if 200 <= r.status < 300:
                out.setdefault(r.msg_id, r)
        return out


def webhook_env(**extra: str) -> dict[str, str]:
    env = base_env()
    env.update(
        {
            "GATE_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
            "GATE_WEBHOOK_RETRY_SCHEDULE": "0.2,0.3,0.3,0.3,0.3",
            "GATE_WEBHOOK_TIMEOUT_SECONDS": "2",
            "GATE_WEBHOOK_INTERVAL_SECONDS": "0.05",
            "GATE_BACKGROUND_LEASE_SECONDS": "1",
            "GATE_SWEEP_INTERVAL_SECONDS": "0.2",
            "GATE_WEBHOOK_WORKERS": "1",
        }
    )
    env.update(extra)
    return env


def verify(secret: str, r: Received) -> dict[str, Any]:
    """What the shop does: the standardwebhooks library's verification (it raises on a
    bad signature or a stale timestamp)."""
    headers = {
        "webhook-id": r.msg_id,
        "webhook-timestamp": r.timestamp,
        "webhook-signature": r.signature,
    }
    verified: dict[str, Any] = Webhook(secret).verify(r.body.decode(), headers)
    return verified


async def create_endpoint(
    client: Client, url: str, events: list[str] | None = None, **fields: Any
) -> dict[str, Any]:
    r = await client.post(
        "/v1/admin/webhook-endpoints",
        json={"url": url, "events": events or ["*"], **fields},
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    made: dict[str, Any] = r.json()
    return made


async def wait_for(
    predicate: Callable[[], Any], timeout_seconds: float = 30.0, every: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(every)


def problem_of(status: int, body: Mapping[str, Any], code: str) -> None:
    assert body["status"] == status and body["code"] == code, body


@pytest.fixture
async def no_endpoints_left(db: Database) -> AsyncIterator[None]:
    """Each webhook test starts and ends with no endpoint enabled: a gate of a later
    test would otherwise keep sending an earlier test's deliveries to its receiver,
    long gone."""
    sql = "UPDATE webhook_endpoints SET status = 'deleted' WHERE status <> 'deleted'"
    await db.execute(sql)
    yield
    await db.execute(sql)
