"""Helpers of the console panels' tests: a waiting room that admits nobody yet,
joins through its proof of work, a buyer's ticket read, and dead letters made for
real (a trigger refuses the deal's order inserts, so every commit of its queued
requests fails until the consumer gives up)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from gate.room.gates import solve
from gate.store.db import Database
from tests.support import Client, Resp, buyer, create_deal

# The panels' gates: fast ticket polls and room loop; a queued request whose commit
# fails is tried twice, RETRY_BASE_SECONDS apart, then dead-lettered.
PANEL_ENV = {
    "GATE_ROOM_POLL_MIN_MS": "100",
    "GATE_ROOM_POLL_MAX_MS": "100",
    "GATE_ROOM_INTERVAL_MS": "50",
    "GATE_QUEUE_ATTEMPTS_MAX": "2",
}


def at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def quiet_room_deal(client: Client, stock: int, low: int, high: int, **more: Any) -> int:
    """A deal whose sale starts in an hour, with a room taking prequeue joins behind a
    challenge of `low`..`high` bits: nobody is admitted, every joiner stays waiting."""
    room = {
        "admit_per_second": 5,
        "prequeue_seconds": 7200,
        "challenge": {"min_bits": low, "max_bits": high},
        **more,
    }
    return await create_deal(client, stock=stock, starts_at=at(3600), waiting_room=room)


async def challenge_bits_now(client: Client, deal_id: int, user_id: int) -> int:
    r = await client.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(user_id))
    assert r.status_code == 200, r.text
    return int(r.json()["bits"])


async def join_with_proof(client: Client, deal_id: int, user_id: int) -> None:
    r = await client.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(user_id))
    assert r.status_code == 200, r.text
    challenge, bits = r.json()["challenge"], int(r.json()["bits"])
    body = {"challenge": challenge, "nonce": solve(challenge, bits)}
    joined = await client.post(f"/v1/deals/{deal_id}/queue", json=body, headers=buyer(user_id))
    assert joined.status_code == 201, joined.text


async def read_ticket(client: Client, deal_id: int, user_id: int) -> dict[str, Any]:
    """The buyer's ticket, waiting out a poll refused as too soon."""
    for _ in range(100):
        r = await client.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user_id))
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body
        await asyncio.sleep(0.05)
    raise AssertionError("ticket reads refused for 5 s")


async def message_read_within(
    client: Client, deal_id: int, user_id: int, wanted: Any, seconds: float = 2.0
) -> Any:
    """The message the buyer's ticket reads carry, read until it is `wanted` or
    `seconds` have passed: the last one read."""
    deadline = time.monotonic() + seconds
    while True:
        message = (await read_ticket(client, deal_id, user_id))["message"]
        if message == wanted or time.monotonic() >= deadline:
            return message
        await asyncio.sleep(0.1)


@asynccontextmanager
async def orders_refused(db: Database, deal_id: int) -> AsyncIterator[None]:
    """While inside: every insert of the deal's orders fails (a permanent failure of
    each commit of its queued requests)."""
    trigger = f"gate_test_panels_refuse_{deal_id}"
    await db.execute(
        f"CREATE TRIGGER {trigger} BEFORE INSERT ON orders FOR EACH ROW"
        f" IF NEW.deal_id = {deal_id} THEN"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'forced failure'; END IF"
    )
    try:
        yield
    finally:
        await db.execute(f"DROP TRIGGER IF EXISTS {trigger}")


async def queued(client: Client, deal_id: int, user_id: int, key: str) -> str:
    """A reservation of a queue-mode deal, accepted (202): its order id."""
    r = await client.post(
        f"/v1/deals/{deal_id}/reservations",
        json={"quantity": 1},
        headers={**buyer(user_id), "Idempotency-Key": key},
    )
    assert r.status_code == 202, r.text
    return str(r.json()["order_id"])


async def dead_letters(db: Database, deal_id: int) -> list[tuple[Any, ...]]:
    return await db.fetchall(
        "SELECT id, order_id, retried_order_id, retried_outcome FROM queue_dead_letters"
        " WHERE deal_id = %s ORDER BY id",
        (deal_id,),
    )


async def until_true(check: Any, what: str, seconds: float = 30.0) -> Any:
    """Await `check()` until it is truthy; its value."""
    deadline = time.monotonic() + seconds
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def problem(r: Resp, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/problem+json", r.headers
    if code is not None:
        assert r.json()["code"] == code, r.text
