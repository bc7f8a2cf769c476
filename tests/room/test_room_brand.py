"""The shop's look on the buyer page over HTTP: a room's `page` set, shown by the admin
view (the logo as its summary) and given to the page by its config read (the logo as
its data: URL, kept in its own column); refused colours, logos, links and names are
400 problem+json and change nothing; the page's headers stay as they were. Real gate
process, real Redis and MariaDB (the browser's side: tests/room/test_buyer_page.py)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from gate.room.page import CSP
from gate.store.db import Database
from tests.png_support import data_url, make
from tests.support import ADMIN, Client, Resp, create_deal

PNG = make(48, 48, (11, 110, 79))
PAGE = {
    "shop_name": "Lantern & Kite <b>灯笼</b>",
    "accent_color": "#0B6E4F",
    "logo": data_url(PNG),
    "help_url": "https://shop.example/help?from=room",
}
ROOM = {"admit_per_second": 50, "return_origins": ["https://shop.example"]}


def problem(r: Resp, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == code, r.text


async def row(db: Database, deal_id: int) -> tuple[Any, ...]:
    found = await db.fetchone(
        "SELECT waiting_room, room_logo, version FROM deals WHERE id = %s", (deal_id,)
    )
    assert found is not None
    return tuple(found)


async def config(client: Client, deal_id: int) -> Resp:
    r = await client.get(f"/room/{deal_id}/config")
    assert r.status_code == 200, r.text
    return r


async def config_until(client: Client, deal_id: int, check: Any) -> dict[str, Any]:
    """The config read once it shows the change (a row at most about a second old)."""
    body: dict[str, Any] = {}
    for _ in range(40):
        body = (await config(client, deal_id)).json()
        if check(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"config never showed the change: {body}")


async def test_a_branded_room_is_stored_viewed_and_served_to_its_page(
    client: Client, db: Database
) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room={**ROOM, "page": PAGE})
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["page"] == {
        "shop_name": PAGE["shop_name"],
        "accent_color": "#0b6e4f",
        "logo": {
            "media_type": "image/png",
            "bytes": len(PNG),
            "sha256": hashlib.sha256(PNG).hexdigest(),
        },
        "help_url": PAGE["help_url"],
    }
    waiting_room, logo, _ = await row(db, deal_id)
    # The logo is in its own column; the room's JSON keeps its bound.
    assert logo == PAGE["logo"] and "base64" not in waiting_room and len(waiting_room) < 4096

    r = await config(client, deal_id)
    assert r.json()["page"] == {
        "shop_name": PAGE["shop_name"],
        "accent_color": "#0b6e4f",
        "accent_text": "#ffffff",
        "logo": PAGE["logo"],
        "help_url": PAGE["help_url"],
    }
    # The page's headers are what they were: the same CSP, no other origin.
    page = await client.get(f"/room/{deal_id}")
    for answer in (r, page):
        assert answer.headers["content-security-policy"] == CSP
        assert "img-src 'self' data:;" in CSP and "http" not in CSP
        assert answer.headers["x-content-type-options"] == "nosniff"

    # A new logo reaches the page; a page removed takes its logo with it.
    other = make(16, 16, (139, 28, 28))
    put = f"/v1/admin/deals/{deal_id}/waiting-room"
    changed = {**PAGE, "logo": data_url(other), "accent_color": "#8a1c1c"}
    r = await client.put(put, json={**ROOM, "page": changed}, headers=ADMIN)
    assert r.status_code == 200, r.text
    body = await config_until(client, deal_id, lambda b: b["page"]["logo"] == data_url(other))
    assert body["page"]["accent_color"] == "#8a1c1c"
    r = await client.put(put, json=ROOM, headers=ADMIN)
    assert r.status_code == 200 and "page" not in r.json()["waiting_room"], r.text
    assert (await config_until(client, deal_id, lambda b: b["page"] is None))["page"] is None
    assert (await row(db, deal_id))[1] is None


async def test_a_room_without_a_page_reads_as_before(client: Client) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room=ROOM)
    assert (await config(client, deal_id)).json()["page"] is None
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert "page" not in view["waiting_room"]


BAD_PAGES = [
    {"accent_color": "#ffd700"},  # 1.4:1 on white
    {"accent_color": "#777777"},  # 4.48:1: just under AA
    {"accent_color": "gold"},
    {"logo": data_url(make(10, 10), "image/gif")},
    {"logo": data_url(make(10, 10))[:-8]},
    {"logo": data_url(make(5000, 1))},
    {
        "logo": data_url(
            b"<svg xmlns='http://www.w3.org/2000/svg'><script>1</script></svg>", "image/svg+xml"
        )
    },
    {"logo": "https://cdn.example/logo.png"},
    {"logo": {"media_type": "image/png", "bytes": 10, "sha256": "0" * 64}},
    {"help_url": "http://shop.example/help"},
    {"help_url": "javascript:alert(1)"},
    {"shop_name": "x" * 81},
    {"shop_name": "tab\tinside"},
    {"shop_name": "ok", "colour": "red"},
    "branded",
]


@pytest.mark.parametrize("page", BAD_PAGES)
async def test_a_refused_page_is_a_400_and_changes_nothing(
    client: Client, db: Database, page: Any
) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room={**ROOM, "page": PAGE})
    before = await row(db, deal_id)
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    r = await client.put(
        f"/v1/admin/deals/{deal_id}/waiting-room", json={**ROOM, "page": page}, headers=ADMIN
    )
    problem(r, 400, "INVALID_REQUEST")
    assert await row(db, deal_id) == before
    after = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert after["waiting_room"] == view["waiting_room"]
    assert (await config(client, deal_id)).json()["page"]["logo"] == PAGE["logo"]
    # Nor is a deal created with it.
    count = await db.fetchone("SELECT COUNT(*) FROM deals")
    body = {"title": "x", "unit_price": 1, "currency": "EUR", "stock": 1}
    r = await client.post(
        "/v1/admin/deals", json={**body, "waiting_room": {**ROOM, "page": page}}, headers=ADMIN
    )
    problem(r, 400, "INVALID_REQUEST")
    assert await db.fetchone("SELECT COUNT(*) FROM deals") == count


async def test_a_body_past_64_kib_is_a_413(client: Client, db: Database) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room=ROOM)
    before = await row(db, deal_id)
    huge = {**ROOM, "page": {"logo": "data:image/png;base64," + "A" * 70_000}}
    r = await client.put(f"/v1/admin/deals/{deal_id}/waiting-room", json=huge, headers=ADMIN)
    problem(r, 413, "PAYLOAD_TOO_LARGE")
    assert await row(db, deal_id) == before
