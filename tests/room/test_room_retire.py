"""Rooms do not leak memory: a removed room's keys, and an ended
sale's room keys once its admission TTL has passed, are deleted by the retire loop
(gate/room/retire.py), and nothing else of the deal is. Real gate processes, real
Redis and MariaDB."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.inventory.check import check_deal
from gate.inventory.room_config import RoomConfig
from gate.room.retire import RoomRetirer, schedule
from gate.room.service import Room
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.keys import ROOMS, ROOMS_RETIRING, deal_keys
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    Resp,
    buyer,
    create_deal,
    reserve,
    running_gate,
)

ROOM = {"admit_per_second": 1000, "admission_ttl_seconds": 10}
BUYERS = (9101, 9102, 9103, 9104)


@pytest.fixture(scope="module")
def quiet_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """A gate without background loops: the test runs the room and retire passes."""
    with running_gate(env, workers=1, background=False) as gate:
        yield gate


@pytest.fixture
async def quiet(quiet_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(quiet_gate.url) as c:
        yield c


@pytest.fixture
async def inproc(settings: Settings, quiet_gate: GateProcess) -> AsyncIterator[Gate]:
    g = Gate(settings)
    await g.start(background=False)
    try:
        yield g
    finally:
        await g.stop()


def _room(g: Gate) -> Room:
    ext = next(e for e in g.extensions if e.name == "room")
    room = ext.workers[0].__self__  # type: ignore[attr-defined]
    assert isinstance(room, Room)
    return room


async def _deal_keys_in_redis(rds: aioredis.Redis, deal_id: int) -> set[str]:
    """The deal's keys, less the resync's lock: a background sync takes it for a
    moment at any time, and it is no part of the room."""
    keys = deal_keys(deal_id)
    found: set[str] = set()
    async for key in rds.scan_iter(match=f"{keys.tag}:*", count=1000):
        found.add(key.decode() if isinstance(key, bytes) else key)
    return found - {keys.sync_lock}


def _room_keys(deal_id: int) -> set[str]:
    """The room's keys: those of the room_*.lua scripts and the admissions ring."""
    keys = deal_keys(deal_id)
    return {*keys.room_state, keys.room_ring}


async def _remove_room(client: Client, deal_id: int) -> Resp:
    """PUT …/waiting-room with null: the room removed."""
    return await client.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        content=b"null",
        headers={**ADMIN, "Content-Type": "application/json"},
    )


async def _filled_room(client: Client, rds: aioredis.Redis, room: Room, **deal: Any) -> int:
    """A deal with a room, more buyers queued than units: two admitted, two waiting;
    every room key exists."""
    deal_id = await create_deal(client, stock=2, waiting_room=ROOM, **deal)
    for user in BUYERS:
        r = await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        assert r.status_code == 201, r.text
    admitted, _ = await room.advance(deal_id)
    assert admitted >= 1
    present = await _deal_keys_in_redis(rds, deal_id)
    room_keys = _room_keys(deal_id)
    # The window and expiry index exist once someone is admitted; the queue while
    # someone waits: every key of the room is there.
    assert room_keys <= present, room_keys - present
    return deal_id


async def test_a_removed_room_is_retired_and_nothing_else_is_deleted(
    quiet: Client, rds: aioredis.Redis, inproc: Gate, db: Database
) -> None:
    room = _room(inproc)
    retirer = RoomRetirer(inproc.redis, inproc.runner)
    deal_id = await _filled_room(quiet, rds, room)
    live_id = await _filled_room(quiet, rds, room)
    before = await _deal_keys_in_redis(rds, deal_id)
    live_before = await _deal_keys_in_redis(rds, live_id)
    room_keys = _room_keys(deal_id)

    removed = await _remove_room(quiet, deal_id)
    assert removed.status_code == 200, removed.text
    assert await rds.zscore(ROOMS_RETIRING, str(deal_id)) is not None
    # A live room scheduled by mistake (or turned on again) is judged live and kept.
    await schedule(rds, live_id)

    # (A serving gate of the suite may run its own retire loop too: the counts of
    # the passes are judged loosely, their outcome exactly.)
    assert await retirer.run_once() <= 2
    after = await _deal_keys_in_redis(rds, deal_id)
    assert not after & room_keys, after & room_keys
    assert after == before - room_keys
    # (Another process's room loop may trim a rate window that has emptied.)
    live_now = await _deal_keys_in_redis(rds, live_id)
    live_keys = deal_keys(live_id)
    assert live_now - _room_keys(live_id) == live_before - _room_keys(live_id)
    assert {live_keys.room, live_keys.room_queue, live_keys.room_tickets} <= live_now
    assert await rds.zscore(ROOMS_RETIRING, str(deal_id)) is None
    assert await rds.zscore(ROOMS_RETIRING, str(live_id)) is None
    assert not await rds.sismember(ROOMS, str(deal_id))
    assert await retirer.run_once() == 0

    # The deal's stock is intact: it sells, without a room now.
    sold = await reserve(quiet, deal_id, BUYERS[0], "retired-room-after")
    assert sold.status_code == 201, sold.text
    view = await quiet.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)
    assert view.json()["waiting_room"] is None
    assert view.json()["totals"]["held"] == 1
    report = await check_deal(db, rds, deal_id)
    assert report["invariant"]["ok"], report
    # The live room still answers its buyers.
    ticket = await quiet.get(f"/v1/deals/{live_id}/queue", headers=buyer(BUYERS[2]))
    assert ticket.status_code in (200, 429), ticket.text


async def test_an_ended_sale_is_retired_after_its_admission_ttl(
    quiet: Client, rds: aioredis.Redis, inproc: Gate, db: Database
) -> None:
    room = _room(inproc)
    retirer = RoomRetirer(inproc.redis, inproc.runner)
    ends = datetime.now(UTC) + timedelta(seconds=2)
    deal_id = await _filled_room(quiet, rds, room, ends_at=ends.isoformat())
    before = await _deal_keys_in_redis(rds, deal_id)
    room_keys = _room_keys(deal_id)
    await asyncio.sleep(max(0.0, ends.timestamp() - time.time()) + 0.2)

    # The room loop sees the sale over and schedules the room.
    assert await room.advance(deal_id) == (0, 0)
    assert not await rds.sismember(ROOMS, str(deal_id))
    assert await rds.zscore(ROOMS_RETIRING, str(deal_id)) is not None
    # Within the admission TTL the tickets still read "closed": nothing deleted, the
    # entry moved to ends_at + TTL.
    assert await retirer.run_once() <= 1
    kept = await _deal_keys_in_redis(rds, deal_id)
    keys = deal_keys(deal_id)
    assert kept - room_keys == before - room_keys
    assert {keys.room, keys.room_queue, keys.room_tickets, keys.room_admitted} <= kept
    due = await rds.zscore(ROOMS_RETIRING, str(deal_id))
    ttl_ms = ROOM["admission_ttl_seconds"] * 1000
    assert due is not None and abs(due - (ends.timestamp() * 1000 + ttl_ms)) < 1000, due
    closed = await quiet.get(f"/v1/deals/{deal_id}/queue", headers=buyer(BUYERS[2]))
    assert closed.status_code == 200 and closed.json()["state"] == "closed", closed.text
    assert await retirer.run_once() == 0  # not due yet: not even looked at

    await asyncio.sleep(max(0.0, due / 1000 - time.time()) + 0.2)
    assert await retirer.run_once() <= 1
    after = await _deal_keys_in_redis(rds, deal_id)
    # The room's hash keeps its configuration only: buyers are still told the sale
    # ended, and gate check's counters balance at zero.
    room_hash = deal_keys(deal_id).room
    assert after == before - (room_keys - {room_hash})
    assert set(await rds.hkeys(room_hash)) <= {
        "on",
        "aps",
        "ttl_ms",
        "pq_ms",
        "method",
        "msg",
        "seed",
        "ver",
        "auto",
        "unl",
    }
    assert await rds.zscore(ROOMS_RETIRING, str(deal_id)) is None
    gone = await quiet.get(f"/v1/deals/{deal_id}/queue", headers=buyer(BUYERS[3]))
    assert gone.status_code == 404 and gone.json()["code"] == "NO_TICKET", gone.text
    late = await quiet.post(f"/v1/deals/{deal_id}/queue", headers=buyer(BUYERS[3]))
    assert late.status_code == 409 and late.json()["code"] == "NOT_ACTIVE", late.text
    report = await check_deal(db, rds, deal_id)
    assert report["invariant"]["ok"], report
    assert report["redis"]["room"]["ok"] and report["redis"]["room"]["tickets"] == 0, report


async def test_the_retire_loop_of_a_serving_gate_deletes_a_removed_room(
    env: dict[str, str], prepared: None, rds: aioredis.Redis
) -> None:
    """Wired up: a gate with its background loops retires a removed room by itself,
    well within a minute."""
    gate = GateProcess(env, background=True)
    client = Client(gate.url)
    try:
        gate.wait_ready()
        deal_id = await create_deal(client, stock=3, waiting_room=ROOM)
        for user in BUYERS:
            r = await client.post(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
            assert r.status_code == 201, r.text
        room_keys = _room_keys(deal_id)
        assert await _deal_keys_in_redis(rds, deal_id) & room_keys
        removed = await _remove_room(client, deal_id)
        assert removed.status_code == 200, removed.text
        deadline = time.monotonic() + 60
        while await _deal_keys_in_redis(rds, deal_id) & room_keys:
            assert time.monotonic() < deadline, "room keys still there after 60 s"
            await asyncio.sleep(0.2)
        assert deal_keys(deal_id).meta in await _deal_keys_in_redis(rds, deal_id)
    finally:
        await client.close()
        gate.stop()


async def test_a_refresh_that_read_the_row_before_a_change_does_not_undo_it(
    quiet: Client, rds: aioredis.Redis, inproc: Gate, db: Database
) -> None:
    """The room loop's refresh reads every open room's row, then publishes each: a PUT
    published in between must stand (lua/room_publish.lua refuses the older version),
    and a room removed in between must stay off (the refresh never sees it again)."""
    room = _room(inproc)
    deal_id = await create_deal(quiet, stock=5, waiting_room=ROOM)
    keys = deal_keys(deal_id)
    row = await db.fetchone(
        "SELECT waiting_room, room_seed, version FROM deals WHERE id = %s", (deal_id,)
    )
    assert row is not None
    old_raw, seed, old_version = row[0], bytes(row[1]), int(row[2])

    changed = await quiet.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        json={**ROOM, "admit_per_second": 7},
        headers=ADMIN,
    )
    assert changed.status_code == 200, changed.text
    assert await rds.hget(keys.room, "aps") in ("7", b"7")

    # The refresh's stale row arrives after the change: refused, nothing moves.
    stale = RoomConfig.from_column(old_raw)
    assert stale is not None and stale.admit_per_second == 1000
    assert not await room.publish(deal_id, old_version, stale, seed)
    assert await rds.hget(keys.room, "aps") in ("7", b"7")
    # The same row read again (its version now) is published, as every refresh does.
    row = await db.fetchone(
        "SELECT waiting_room, room_seed, version FROM deals WHERE id = %s", (deal_id,)
    )
    assert row is not None
    current = RoomConfig.from_column(row[0])
    assert await room.publish(deal_id, int(row[2]), current, seed)
    assert await rds.hget(keys.room, "aps") in ("7", b"7")

    removed = await _remove_room(quiet, deal_id)
    assert removed.status_code == 200, removed.text
    assert await rds.hget(keys.room, "on") in ("0", b"0")
    assert not await room.publish(deal_id, int(row[2]), current, seed)
    assert await rds.hget(keys.room, "on") in ("0", b"0")
    assert not await rds.sismember(ROOMS, str(deal_id))
    assert deal_id not in await room.refresh()
    # Buyers are not queued any more: the deal sells without a room.
    sold = await reserve(quiet, deal_id, BUYERS[3], "after-stale-refresh")
    assert sold.status_code == 201, sold.text
