"""The waiting room's fairness: the admission method, the verifiable draw (recomputed
here as a third party would, from the fairness document alone), the message to
waiters, and their bad values. Real gate processes, real Redis and MariaDB."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import hmac
import random
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings
from gate.room.fairness import DRAW_KEEP_MS, draw_key
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.room.test_room import (  # noqa: F401 (fixtures)
    _at,
    join,
    problem,
    rc,
    read_ok,
    room_gates,
    wait_state,
)
from tests.store.test_db_statements import (  # noqa: F401 (fixture)
    StatementCounter,
    _highest_deal_id,
    _per_request,
    counted_gate,
)
from tests.support import ADMIN, Client, GateProcess, Resp, create_deal

RULE = "hmac-sha256(seed, ticket_id) ascending"
DOC_FIELDS = {
    "deal_id",
    "method",
    "commitment",
    "seed",
    "rule",
    "participants",
    "participants_total",
    "next",
}


async def fairness(client: Client, deal_id: int) -> dict[str, Any]:
    r = await client.get(f"/v1/deals/{deal_id}/queue/fairness")
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    assert set(doc) == DOC_FIELDS
    assert doc["deal_id"] == deal_id and doc["rule"] == RULE
    return doc


async def all_pages(client: Client, deal_id: int, limit: int) -> list[dict[str, Any]]:
    """The revealed document page by page, following each page's `next` link."""
    r = await client.get(f"/v1/deals/{deal_id}/queue/fairness?limit={limit}")
    pages = []
    while True:
        assert r.status_code == 200, r.text
        page: dict[str, Any] = r.json()
        assert set(page) == DOC_FIELDS and len(page["participants"]) <= limit
        pages.append(page)
        if page["next"] is None:
            return pages
        r = await client.get(page["next"])


def joined(pages: list[dict[str, Any]]) -> dict[str, Any]:
    """What a third party puts together from the pages: every page carries the
    commitment and the seed, the participants come in ticket id order."""
    first = pages[0]
    for page in pages:
        for field in ("deal_id", "method", "commitment", "seed", "rule", "participants_total"):
            assert page[field] == first[field], (field, page[field], first[field])
    ids = [t for page in pages for t in page["participants"]]
    assert ids == sorted(ids) and len(ids) == first["participants_total"]
    return {**first, "participants": ids, "next": None}


def third_party_order(doc: dict[str, Any]) -> list[str]:
    """What anyone can do with the document: check the seed against the commitment
    published before, then sort the participants by the rule."""
    seed = bytes.fromhex(doc["seed"])
    assert hashlib.sha256(seed).hexdigest() == doc["commitment"]

    def drawn(ticket_id: str) -> str:
        return hmac.new(seed, ticket_id.encode(), hashlib.sha256).hexdigest()

    return sorted(doc["participants"], key=drawn)


def admission_seq(ticket: dict[str, Any]) -> int:
    """The admission's sequence number, from the token the buyer was handed
    (`deal.user.seq.expires.signature`): lower was admitted first."""
    assert ticket["state"] == "admitted", ticket
    return int(ticket["admission_token"].split(".")[2])


def in_order(ranks: list[int], users: list[int], tickets: dict[int, str]) -> list[str]:
    """The buyers' ticket ids, lowest rank first."""
    return [tickets[u] for _, u in sorted(zip(ranks, users, strict=True))]


async def wait_revealed(client: Client, deal_id: int, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        doc = await fairness(client, deal_id)
        if doc["seed"] is not None:
            return doc
        assert time.monotonic() < deadline, f"never revealed: {doc}"
        await asyncio.sleep(0.2)


async def add_stock(client: Client, deal_id: int, units: int) -> None:
    r = await client.post(
        f"/v1/admin/deals/{deal_id}/stock",
        json={"delta": units, "reason": "fairness"},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text


# -- the draw ----------------------------------------------------------------------------


async def test_a_prequeue_draw_is_recomputed_from_the_fairness_document(
    rc: list[Client],  # noqa: F811
) -> None:
    a, b = rc
    n = 40
    deal_id = await create_deal(
        a,
        stock=n + 5,
        starts_at=_at(6),
        waiting_room={"admit_per_second": 10_000, "prequeue_seconds": 600},
    )
    before = await fairness(b, deal_id)
    # Committed at creation; nothing revealed before the opening.
    assert before["method"] == "fifo" and len(before["commitment"]) == 64
    assert before["seed"] is None and before["participants"] is None
    users = list(range(200_000, 200_000 + n))
    tickets = {}
    for u in users:
        r = await join((a, b)[u % 2], deal_id, u)
        assert r.status_code == 201, r.text
        tickets[u] = r.json()["ticket_id"]
    assert len(set(tickets.values())) == n
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in tickets.values())
    # Stable: every read shows the same ticket id.
    assert (await read_ok(b, deal_id, users[0]))["ticket_id"] == tickets[users[0]]
    assert (await fairness(a, deal_id))["seed"] is None

    doc = await wait_revealed(a, deal_id, 30)
    assert doc["commitment"] == before["commitment"]
    assert sorted(doc["participants"]) == sorted(tickets.values())
    # Joiners after the opening (fifo) are not drawn: they queue behind, in join order.
    late = await join(a, deal_id, 209_999)
    assert late.status_code == 201, late.text
    assert late.json()["ticket_id"] not in (await fairness(b, deal_id))["participants"]

    admitted = [await wait_state((a, b)[u % 2], deal_id, u, "admitted") for u in users]
    by_admission = in_order([admission_seq(t) for t in admitted], users, tickets)
    assert by_admission == third_party_order(doc)
    # The same from pages of 7 (each with the commitment and the seed), read from
    # both processes.
    pages = await all_pages(b, deal_id, 7)
    assert len(pages) == 6 and [len(p["participants"]) for p in pages] == [7] * 5 + [5]
    assert third_party_order(joined(pages)) == by_admission
    late_ticket = await wait_state(a, deal_id, 209_999, "admitted")
    assert admission_seq(late_ticket) > max(map(admission_seq, admitted))


async def test_a_random_room_admits_in_the_draw_order_anyone_can_recompute(
    rc: list[Client],  # noqa: F811
) -> None:
    a, b = rc
    n = 30
    deal_id = await create_deal(
        a,
        stock=1,
        ends_at=_at(25),
        waiting_room={"admit_per_second": 10_000, "method": "random"},
    )
    before = await fairness(a, deal_id)
    assert before["method"] == "random" and before["seed"] is None
    # The one unit's admission held: everyone after it waits, ranked by the draw.
    assert (await join(a, deal_id, 210_000)).status_code == 201
    first = await wait_state(a, deal_id, 210_000, "admitted")
    users = list(range(210_001, 210_001 + n))
    tickets = {}
    for u in users:  # one at a time: joining early must buy nothing
        r = await join((a, b)[u % 2], deal_id, u)
        assert r.status_code == 201, r.text
        tickets[u] = r.json()["ticket_id"]
    waiting = [await read_ok((a, b)[u % 2], deal_id, u) for u in users]
    assert sorted(t["position"] for t in waiting) == list(range(1, n + 1))
    by_position = in_order([t["position"] for t in waiting], users, tickets)
    assert by_position != [tickets[u] for u in users]  # not join order (1 in 30!)

    await add_stock(a, deal_id, n)
    admitted = [await wait_state((a, b)[u % 2], deal_id, u, "admitted") for u in users]
    by_admission = in_order([admission_seq(t) for t in admitted], users, tickets)
    assert by_admission == by_position
    # Before the sale ends the draw stays sealed: no one can compute it yet.
    assert (await fairness(b, deal_id))["seed"] is None

    doc = await wait_revealed(b, deal_id, 40)
    assert doc["commitment"] == before["commitment"] and doc["method"] == "random"
    assert sorted(doc["participants"]) == sorted([first["ticket_id"], *tickets.values()])
    recomputed = [t for t in third_party_order(doc) if t != first["ticket_id"]]
    assert recomputed == by_admission


async def test_fairness_refusals(client: Client) -> None:
    plain = await create_deal(client, stock=1)
    r = await client.get(f"/v1/deals/{plain}/queue/fairness")
    problem(r, 409, "NO_WAITING_ROOM")
    problem(await client.get("/v1/deals/999999999/queue/fairness"), 404, "NOT_FOUND")
    problem(await client.get(f"/v1/deals/{'9' * 30}/queue/fairness"), 404, "NOT_FOUND")
    # A fifo room of a deal open from the start has had no prequeue: revealed, empty.
    open_deal = await create_deal(client, stock=1, waiting_room={"admit_per_second": 5})
    doc = await fairness(client, open_deal)
    assert doc["participants"] == [] and doc["seed"] is not None
    # The commitment never changes, whatever the room's configuration does.
    path = f"/v1/admin/deals/{open_deal}/waiting-room"
    for room in ({"admit_per_second": 9, "method": "random"}, None, {"admit_per_second": 3}):
        r = await client.put(
            path,
            content=orjson.dumps(room),
            headers={**ADMIN, "Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
    assert (await fairness(client, open_deal))["commitment"] == doc["commitment"]


# -- a large draw: pages, one encoding, ETag and gzip, a limit per address --------------


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_a_large_draw_is_paged_encoded_once_and_served_with_etag_and_gzip(
    rc: list[Client],  # noqa: F811
    rds: aioredis.Redis,
) -> None:
    a, b = rc
    # Revealed at once (the sale started a minute ago); its prequeue's draw list, as a
    # crowd of 25,000 prequeue joiners would have left it.
    deal_id = await create_deal(
        a, stock=5, starts_at=_at(-60), waiting_room={"admit_per_second": 100}
    )
    drawn = [secrets.token_hex(16) for _ in range(25_000)]
    for i in range(0, len(drawn), 5000):
        await rds.rpush(draw_key(deal_id), *drawn[i : i + 5000])
    url = f"/v1/deals/{deal_id}/queue/fairness"
    encodings = _metric(await a.metrics(), "gate_room_fairness_encodings_total")

    first = await a.get(url)
    assert first.status_code == 200, first.text
    assert len(first.content) < 1_000_000
    doc = first.json()
    assert set(doc) == DOC_FIELDS and doc["participants_total"] == 25_000
    assert len(doc["participants"]) == 10_000
    assert doc["next"] == f"{url}?after={doc['participants'][-1]}&limit=10000"
    pages = [doc]
    while pages[-1]["next"]:
        r = await (a, b)[len(pages) % 2].get(pages[-1]["next"])
        assert r.status_code == 200, r.text
        pages.append(r.json())
    assert [len(p["participants"]) for p in pages] == [10_000, 10_000, 5_000]
    whole = joined(pages)
    assert whole["participants"] == sorted(drawn)
    # Still a document anyone can check: the seed against the commitment, the rule.
    assert len(third_party_order(whole)) == 25_000

    ordered = sorted(drawn)
    r = await b.get(f"{url}?after={ordered[5]}&limit=2")
    assert r.json()["participants"] == ordered[6:8], r.text
    assert r.json()["next"] == f"{url}?after={ordered[7]}&limit=2"
    r = await b.get(f"{url}?after={ordered[-1]}")
    assert r.json()["participants"] == [] and r.json()["next"] is None
    # `after` is a bound, not a look-up: any ticket id sorts somewhere.
    r = await b.get(f"{url}?after={'0' * 32}&limit=1")
    assert r.json()["participants"] == ordered[:1]
    for bad in ("limit=0", "limit=10001", "limit=x", "after=XYZ", "after=abc", f"after={'A' * 32}"):
        problem(await a.get(f"{url}?{bad}"), 400, "INVALID_REQUEST")

    # Encoded once per change: the requests above (both processes) cost one encoding
    # in this process, however many pages were served from it.
    for _ in range(20):
        assert (await a.get(f"{url}?limit=100")).status_code == 200
    assert _metric(await a.metrics(), "gate_room_fairness_encodings_total") == encodings + 1

    # ETag and 304; gzip when asked.
    async with aiohttp.ClientSession(auto_decompress=False) as raw:
        plain_headers = {"Accept-Encoding": "identity"}
        async with raw.get(a.base_url + url, headers=plain_headers) as plain:
            assert plain.status == 200
            body = await plain.read()
            tag = plain.headers["ETag"]
            assert "Content-Encoding" not in plain.headers
            assert plain.headers["Vary"] == "Accept-Encoding"
        assert orjson.loads(body) == doc
        async with raw.get(a.base_url + url, headers={"Accept-Encoding": "gzip"}) as zipped:
            assert zipped.status == 200
            assert zipped.headers["Content-Encoding"] == "gzip"
            zipped_tag = zipped.headers["ETag"]
            assert gzip.decompress(await zipped.read()) == body
            assert zipped_tag != tag
        for client_tag in (tag, zipped_tag, f'W/{tag}, "other"'):
            for served_by in (a, b):  # the same tags in every process
                headers = {**plain_headers, "If-None-Match": client_tag}
                async with raw.get(served_by.base_url + url, headers=headers) as again:
                    assert again.status == 304
                    assert await again.read() == b""
                    assert again.headers["ETag"] == tag
        other_page = {**plain_headers, "If-None-Match": tag}
        async with raw.get(a.base_url + url + "?limit=5", headers=other_page) as r2:
            assert r2.status == 200
    # A change (the draw list lost in a flush) is a new document, with a new tag.
    await rds.ltrim(draw_key(deal_id), 0, 99)
    r = await a.get(url)
    assert r.json()["participants_total"] == 100 and r.headers["ETag"] != tag


@pytest.fixture(scope="module")
def limited_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    proc = GateProcess(
        {**env, "GATE_ROOM_FAIRNESS_LIMIT": "4/m burst 4", "GATE_TRUSTED_PROXIES": "127.0.0.1/32"},
        workers=1,
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


async def test_fairness_reads_are_limited_per_client_address(limited_gate: GateProcess) -> None:
    client = Client(limited_gate.url)
    try:
        deal_id = await create_deal(client, stock=1, waiting_room={"admit_per_second": 5})
        url = f"/v1/deals/{deal_id}/queue/fairness"
        first = {"X-Forwarded-For": "10.1.0.1"}
        for _ in range(4):
            assert (await client.get(url, headers=first)).status_code == 200
        r = await client.get(url, headers=first)
        body = problem(r, 429, "RATE_LIMITED")
        assert body["scope"] == "fairness" and int(r.headers["Retry-After"]) >= 1
        # Unknown deals count too (the limit comes first), other addresses do not.
        problem(
            await client.get("/v1/deals/999999999/queue/fairness", headers=first),
            429,
            "RATE_LIMITED",
        )
        r = await client.get(url, headers={"X-Forwarded-For": "10.1.0.2"})
        assert r.status_code == 200, r.text
    finally:
        await client.close()


@pytest.fixture
async def counted_client(
    counted_gate: tuple[GateProcess, StatementCounter],  # noqa: F811
) -> AsyncIterator[Client]:
    c = Client(counted_gate[0].url)
    try:
        yield c
    finally:
        await c.close()


@pytest.mark.slow
async def test_fairness_of_unknown_deals_stays_off_the_database(
    counted_client: Client,
    counted_gate: tuple[GateProcess, StatementCounter],  # noqa: F811
    settings: Settings,
) -> None:
    floor = await _highest_deal_id(settings) + 1_000_000
    rng = random.Random(91)

    async def send(i: int) -> Resp:
        return await counted_client.get(f"/v1/deals/{rng.randrange(floor, 2**62)}/queue/fairness")

    assert await _per_request(counted_gate[1], send, 404) <= 0.05


# -- the message -------------------------------------------------------------------------


async def test_every_ticket_read_carries_the_message_soon_after_a_change(
    rc: list[Client],  # noqa: F811
) -> None:
    a, b = rc
    said = {"text": "Doors open at noon. 门将在中午打开 🚪", "level": "info"}
    deal_id = await create_deal(a, stock=0, waiting_room={"admit_per_second": 10, "message": said})
    r = await join(a, deal_id, 220_001)
    assert r.status_code == 201 and r.json()["message"] == said, r.text
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    for message in ({"text": "w" * 280, "level": "warning"}, None):
        r = await a.put(path, json={"admit_per_second": 10, "message": message}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["waiting_room"]["message"] == message, r.text
        # The next read, through the other process, already carries it.
        assert (await read_ok(b, deal_id, 220_001))["message"] == message
    view = (await a.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["message"] is None and view["waiting_room"]["method"] == "fifo"


# -- bad values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "room",
    [
        {"admit_per_second": 5, "method": "lifo"},
        {"admit_per_second": 5, "method": "RANDOM"},
        {"admit_per_second": 5, "method": None},
        {"admit_per_second": 5, "method": 1},
        {"admit_per_second": 5, "message": "hello"},
        {"admit_per_second": 5, "message": {}},
        {"admit_per_second": 5, "message": {"text": ""}},
        {"admit_per_second": 5, "message": {"text": "x" * 281}},
        {"admit_per_second": 5, "message": {"text": 7}},
        {"admit_per_second": 5, "message": {"text": "a\x00b"}},
        {"admit_per_second": 5, "message": {"text": "a", "level": "error"}},
        {"admit_per_second": 5, "message": {"text": "a", "level": None}},
        {"admit_per_second": 5, "message": {"text": "a", "colour": "red"}},
    ],
)
async def test_bad_method_or_message_is_a_400_and_changes_nothing(
    client: Client, db: Database, room: Any
) -> None:
    before = await db.fetchone("SELECT COUNT(*) FROM deals")
    body = {"title": "x", "unit_price": 1, "currency": "EUR", "stock": 1, "waiting_room": room}
    problem(await client.post("/v1/admin/deals", json=body, headers=ADMIN), 400, "INVALID_REQUEST")
    assert await db.fetchone("SELECT COUNT(*) FROM deals") == before
    set_up = {"admit_per_second": 3, "method": "random", "message": {"text": "hi"}}
    deal_id = await create_deal(client, stock=1, waiting_room=set_up)
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    problem(await client.put(path, json=room, headers=ADMIN), 400, "INVALID_REQUEST")
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"] == {
        "admit_per_second": 3,
        "admission_ttl_seconds": 120,
        "prequeue_seconds": 0,
        "method": "random",
        "message": {"text": "hi", "level": "info"},
        "unlikely_below": 0.02,
    }
    r = await join(client, deal_id, 230_001)
    assert r.status_code == 201 and r.json()["message"] == {"text": "hi", "level": "info"}


# -- retirement --------------------------------------------------------------------------


async def wait_for(check: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


async def test_an_ended_draw_outlives_its_tickets_for_a_while_a_removed_one_does_not(
    rc: list[Client],  # noqa: F811
    rds: aioredis.Redis,
) -> None:
    """The retire loop (gate/room/retire.py) deletes an ended sale's tickets but keeps
    its draw list, for DRAW_KEEP_MS, so the document stays checkable; a removed
    room's draw list goes with its other keys."""
    a, _ = rc
    room = {"admit_per_second": 100, "admission_ttl_seconds": 10, "method": "random"}
    ended = await create_deal(a, stock=0, ends_at=_at(3), waiting_room=room)
    removed = await create_deal(a, stock=0, waiting_room=room)
    for deal_id in (ended, removed):
        for u in (240_001, 240_002):
            assert (await join(a, deal_id, u)).status_code == 201
    keys = deal_keys(ended)

    async def tickets_gone() -> bool:
        return not await rds.exists(keys.room_tickets)

    # ends_at + the admission TTL, then the retire loop's pass (every 5 s).
    await wait_for(tickets_gone, 40, "the ended room was never retired")
    ttl_ms = await rds.pttl(draw_key(ended))
    assert 0 < ttl_ms <= DRAW_KEEP_MS, ttl_ms
    doc = await fairness(a, ended)
    assert doc["seed"] is not None and len(doc["participants"]) == 2

    r = await a.put(
        f"/v1/admin/deals/{removed}/waiting-room",
        content=b"null",
        headers={**ADMIN, "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text

    async def draw_gone() -> bool:
        return not await rds.exists(draw_key(removed))

    await wait_for(draw_gone, 20, "the removed room's draw list was kept")
    problem(await a.get(f"/v1/deals/{removed}/queue/fairness"), 409, "NO_WAITING_ROOM")
