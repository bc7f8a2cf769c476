"""The console checks what the admin API checks, against a real gate process (real
Redis and MariaDB): every console action answers bad input with the same problem
(status, code and detail) as the admin API route doing the same change, a 4xx,
never a 5xx, and changes nothing; the room's message within the bound the admin
API puts on the whole room (its column)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.console_support import ConsoleSession, console_env, sign_in
from tests.panels_support import quiet_room_deal
from tests.support import ADMIN, Client, GateProcess, Resp, assert_invariants, create_deal

# Sixteen return origins of 98 characters, the most a room may list.
LONG_ORIGINS = [f"https://{'o' * 80}{i:02d}.example" for i in range(16)]
# 280 characters (the message's bound), each escaped to 12 in the room's ASCII column.
EMOJI_TEXT = "\U0001f600" * 280


@pytest.fixture(scope="module")
def console_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    with GateProcess(console_env(env), workers=1) as proc:
        yield proc


@pytest.fixture
async def cc(console_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(console_gate.url) as c:
        yield c


@pytest.fixture
async def op(cc: Client) -> ConsoleSession:
    r, session = await sign_in(cc)
    assert r.status_code == 200 and session is not None, r.text
    return session


def refusal(r: Resp) -> tuple[int, str, str]:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.headers["Content-Type"] == "application/problem+json", r.text
    body = r.json()
    return r.status_code, body["code"], body["detail"]


async def deal_state(db: Database, deal_id: int) -> tuple[Any, ...]:
    row = await db.fetchone(
        "SELECT waiting_room, version, starts_at, ends_at, bucket_count FROM deals WHERE id = %s",
        (deal_id,),
    )
    ledger = await db.fetchone(
        "SELECT COUNT(*), COALESCE(MAX(id), 0) FROM inventory_ledger WHERE deal_id = %s",
        (deal_id,),
    )
    assert row is not None and ledger is not None
    return (*row, *ledger)


async def test_a_message_that_does_not_fit_the_room_is_a_400_as_on_the_admin_api(
    cc: Client, op: ConsoleSession, db: Database, rds: aioredis.Redis
) -> None:
    """280 emoji on a room with 16 long return origins: the admin API refuses the
    room with 400, and the console's message edit, once a 500 (MariaDB 1406, data
    too long), refuses it with the same problem; nothing changes."""
    deal_id = await quiet_room_deal(cc, stock=3, low=0, high=2, return_origins=LONG_ORIGINS)
    view = (await cc.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    room = view["waiting_room"]
    assert room["return_origins"] == LONG_ORIGINS
    before = await deal_state(db, deal_id)
    message = {"text": EMOJI_TEXT, "level": "warning"}

    # Sent as UTF-8 (4 bytes an emoji), within the 4 KiB body bound of both routes.
    json_headers = {"Content-Type": "application/json"}
    admin = await cc.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        content=orjson.dumps({**room, "message": message}),
        headers={**ADMIN, **json_headers},
    )
    console = await cc.post(
        f"/console/api/deals/{deal_id}/room_message",
        content=orjson.dumps({"message": message}),
        headers={**op.write(), **json_headers},
    )
    assert refusal(console) == refusal(admin)
    assert refusal(console)[:2] == (400, "INVALID_REQUEST")
    assert await deal_state(db, deal_id) == before

    # A message that fits is taken, by both, alike.
    fits = {"text": "\U0001f600" * 150, "level": "info"}
    r = await cc.post(
        f"/console/api/deals/{deal_id}/room_message", json={"message": fits}, headers=op.write()
    )
    assert r.status_code == 200, r.text
    assert r.json()["waiting_room"]["message"] == fits
    await assert_invariants(db, rds, deal_id)


# (console action, admin method, admin path under /v1/admin/deals/{id}, bodies)
PAIRS = (
    (
        "stock",
        "post",
        "/stock",
        [
            [],
            None,
            "x",
            {},
            {"delta": 2**64, "reason": "x"},
            {"delta": -(2**64), "reason": "x"},
            {"delta": 1.5, "reason": "x"},
            {"delta": 1e308, "reason": "x"},
            {"delta": True, "reason": "x"},
            {"delta": "1", "reason": "x"},
            {"delta": 1, "reason": ""},
            {"delta": 1, "reason": "\U0001f600" * 256},
            {"delta": 1, "reason": "x" * 3000},
            {"delta": 1},
            {"delta": 1, "reason": "x", "extra": 1},
            {"delta": -(10**9), "reason": "more than there is"},
        ],
    ),
    (
        "buckets",
        "put",
        "/buckets",
        [[], None, {}, {"count": 0}, {"count": 10**6}, {"count": "2"}, {"count": 2, "x": 1}],
    ),
    (
        "window",
        "put",
        "/window",
        [
            [],
            {},
            {"starts_at": None},
            {"starts_at": "0001-01-01T00:00:00+01:00", "ends_at": None},
            {"starts_at": "9999-12-31T23:59:59-01:00", "ends_at": None},
            {"starts_at": "\U0001f600", "ends_at": None},
            {"starts_at": 1, "ends_at": None},
            {"starts_at": "2099-01-02T00:00:00Z", "ends_at": "2099-01-01T00:00:00Z"},
            {"starts_at": None, "ends_at": None, "x": 1},
        ],
    ),
)


@pytest.mark.parametrize(("action", "method", "path", "bodies"), PAIRS, ids=[p[0] for p in PAIRS])
async def test_each_console_action_refuses_what_its_admin_route_refuses(
    cc: Client,
    op: ConsoleSession,
    db: Database,
    rds: aioredis.Redis,
    action: str,
    method: str,
    path: str,
    bodies: list[Any],
) -> None:
    deal_id = await create_deal(cc, stock=5, buckets=2)
    before = await deal_state(db, deal_id)
    for body in bodies:
        admin = await getattr(cc, method)(
            f"/v1/admin/deals/{deal_id}{path}", json=body, headers=ADMIN
        )
        console = await cc.post(
            f"/console/api/deals/{deal_id}/{action}", json=body, headers=op.write()
        )
        assert refusal(console) == refusal(admin), (action, body)
    # Not JSON, too long: the same refusals too.
    for content in (b"{", b"\xff\xfe", b'{"delta": 1, "reason": "' + b"x" * 5000 + b'"}'):
        headers = {"Content-Type": "application/json"}
        admin = await getattr(cc, method)(
            f"/v1/admin/deals/{deal_id}{path}", content=content, headers={**ADMIN, **headers}
        )
        console = await cc.post(
            f"/console/api/deals/{deal_id}/{action}",
            content=content,
            headers={**op.write(), **headers},
        )
        assert refusal(console) == refusal(admin), (action, content[:20])
    assert await deal_state(db, deal_id) == before
    await assert_invariants(db, rds, deal_id)
