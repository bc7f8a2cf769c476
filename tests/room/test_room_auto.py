"""The automatic admission rate ("admit_per_second": "auto") against a real gate,
Redis and MariaDB: it grows while the database keeps up and backs off when commits
wait (a test connection holds the deal's bucket rows locked), and the console's room
panel shows the rate chosen and why."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.store.keys import deal_keys
from tests.console_support import console_env, sign_in
from tests.support import ADMIN, Client, GateProcess, buyer, create_deal, locked_buckets

CAP = 20
REASONS = {
    "no_units",
    "learning",
    "in_flight_full",
    "filling",
    "cap",
    "starting",
    "db_backoff",
    "db_recovering",
}
ROOM = {"admit_per_second": "auto", "max_admit_per_second": CAP, "admission_ttl_seconds": 30}


@pytest.fixture(scope="module")
def auto_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(
        console_env(
            env,
            GATE_ROOM_POLL_MIN_MS="100",
            GATE_ROOM_POLL_MAX_MS="100",
            GATE_ROOM_INTERVAL_MS="50",
        ),
        workers=2,
    ) as proc:
        yield proc


@pytest.fixture
async def ac(auto_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(auto_gate.url) as client:
        yield client


class Buyers:
    """Every admitted buyer reserves at once (found through the room's admissions in
    Redis: polling hundreds of waiting tickets would load the machine instead)."""

    def __init__(self, client: Client, rds: aioredis.Redis, deal_id: int) -> None:
        self.client, self.rds, self.deal_id = client, rds, deal_id
        self.seen: set[int] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stop = asyncio.Event()

    async def run(self) -> None:
        admitted = deal_keys(self.deal_id).room_admitted
        while not self.stop.is_set():
            for raw in await self.rds.hkeys(admitted):
                user = int(raw)
                if user not in self.seen:
                    self.seen.add(user)
                    task = asyncio.create_task(self.reserve(user))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(0.1)

    async def reserve(self, user: int) -> None:
        for _ in range(20):
            r = await self.client.get(f"/v1/deals/{self.deal_id}/queue", headers=buyer(user))
            if r.status_code == 200 and r.json()["admission_token"]:
                headers = {
                    **buyer(user),
                    "Idempotency-Key": f"auto-{user}",
                    "Admission-Token": r.json()["admission_token"],
                }
                await self.client.post(
                    f"/v1/deals/{self.deal_id}/reservations", json={"quantity": 1}, headers=headers
                )
                return
            await asyncio.sleep(0.1)


async def _decision(rds: aioredis.Redis, deal_id: int) -> dict[str, Any]:
    rate, reason, at = await rds.hmget(deal_keys(deal_id).room, ["arate", "areason", "aat"])
    return {"rate": int(rate) if rate else None, "reason": reason, "at": at}


async def test_auto_rate_backs_off_when_commits_wait(
    ac: Client, rds: aioredis.Redis, settings: Settings
) -> None:
    r = await ac.post(
        "/v1/admin/deals",
        json={"title": "t", "unit_price": 1, "currency": "EUR", "stock": 1, "waiting_room": ROOM},
        headers=ADMIN,
    )
    assert r.status_code == 201, r.text
    assert r.json()["waiting_room"]["admit_per_second"] == "auto"
    assert r.json()["waiting_room"]["max_admit_per_second"] == CAP

    deal_id = await create_deal(ac, stock=1000, waiting_room=ROOM)
    await asyncio.gather(
        *(ac.post(f"/v1/deals/{deal_id}/queue", headers=buyer(u)) for u in range(80_000, 80_400))
    )
    buyers = Buyers(ac, rds, deal_id)
    runner = asyncio.create_task(buyers.run())
    try:
        # Healthy: slow start from a tenth of the cap, doubling each second.
        deadline = time.monotonic() + 15
        best = 0
        while time.monotonic() < deadline and best < CAP * 3 // 4:
            best = max(best, (await _decision(rds, deal_id))["rate"] or 0)
            await asyncio.sleep(0.2)
        assert best >= CAP * 3 // 4, best
        assert len(buyers.seen) > 0

        # The database slowed: every reservation's commit waits on the locked rows.
        async with locked_buckets(settings, deal_id):
            deadline = time.monotonic() + 15
            low, signals = best, []
            while time.monotonic() < deadline and low > best // 2:
                low = min(low, (await _decision(rds, deal_id))["rate"] or best)
                raw = await rds.hget(deal_keys(deal_id).room, "adetail")
                detail = json.loads(raw) if raw else {}
                if (
                    detail.get("overloaded", 0) > 0
                    or detail.get("pool_waits", 0) > 0
                    or detail.get("commit_p99_ms", 0) > 250
                ):
                    signals.append(detail)
                await asyncio.sleep(0.2)
        assert low <= best // 2, (best, low)
        # What the decider saw: the database at its limit.
        assert signals, "no 503, pool wait or slow commit seen by the decider"

        # The console's room panel shows the rate chosen and why.
        r, op = await sign_in(ac)
        assert r.status_code == 200 and op is not None, r.text
        shown: dict[str, Any] = {}
        for _ in range(30):
            snap = await ac.get("/console/api/snapshot", headers=op.read())
            assert snap.status_code == 200, snap.text
            entry: dict[str, Any] = next(
                (d for d in snap.json()["deals"] if d["id"] == deal_id), {}
            )
            shown = entry.get("waiting_room", {}).get("auto") or {}
            if shown.get("rate") is not None:
                break
            await asyncio.sleep(0.2)
        assert shown["reason"] in REASONS and shown["detail"]["ceiling"] > 0, shown
    finally:
        buyers.stop.set()
        await runner
        await asyncio.gather(*list(buyers.tasks), return_exceptions=True)
