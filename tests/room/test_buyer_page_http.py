"""The buyer page over plain HTTP (gate/room/page.py): its answers carry a strict
Content-Security-Policy and load nothing from elsewhere, its files have their types,
unknown deals and deals without a room are 404 problems (a random id without the
database), and the room's `return_origins` take only exact https origins (http for
loopback names), every other value a 400 that changes nothing. The page itself in a
browser: tests/room/test_buyer_page.py."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gate.base.settings import Settings
from gate.room.page import CSP
from tests.room.test_room_fairness import _highest_deal_id
from tests.store.test_db_statements import (  # noqa: F401 (fixture)
    StatementCounter,
    _per_request,
    counted_gate,
)
from tests.support import ADMIN, Client, GateProcess, Resp, create_deal

SHOP = "https://shop.example"


def room(**more: Any) -> dict[str, Any]:
    return {"admit_per_second": 10, "return_origins": [SHOP], **more}


def problem(r: Resp, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/problem+json"), r.headers
    assert r.json()["code"] == code, r.text


async def eventually(client: Client, path: str, done: Callable[[Resp], bool]) -> Resp:
    """GET path until `done` holds of the answer (a cached deal row lapses), at most 10 s."""
    for _ in range(100):
        r = await client.get(path)
        if done(r):
            break
        await asyncio.sleep(0.1)
    return r


def strict(r: Resp) -> None:
    csp = r.headers["Content-Security-Policy"]
    assert csp == CSP
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    for name in ("script-src", "worker-src", "connect-src", "style-src"):
        assert directives[name] == "'self'", name
    assert directives["frame-ancestors"] == "'none'"
    assert directives["form-action"] == "'none'"
    assert directives["base-uri"] == "'none'"
    assert "unsafe" not in csp and "*" not in csp and "http" not in csp
    assert r.headers["Referrer-Policy"] == "no-referrer"
    assert r.headers["X-Content-Type-Options"] == "nosniff"


async def test_the_page_and_its_files_are_the_gates_own_under_a_strict_policy(
    client: Client,
) -> None:
    deal_id = await create_deal(client, stock=5, waiting_room=room())
    r = await client.get(f"/room/{deal_id}")
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert r.headers["Cache-Control"] == "no-store"
    strict(r)
    html = r.text
    # Nothing from elsewhere, nothing inline: only the gate's own files.
    assert "://" not in html
    assert "<style" not in html and "style=" not in html
    assert not re.search(r"\son[a-z]+=", html), "an inline event handler"
    scripts = re.findall(r"<script([^>]*)>", html)
    assert scripts and all('src="/room/static/' in s for s in scripts), scripts
    assert 'aria-live="polite"' in html
    assert re.search(r'href="/room/static/page\.css"', html)
    types = {
        "page.js": "text/javascript; charset=utf-8",
        "pow.js": "text/javascript; charset=utf-8",
        "page.css": "text/css; charset=utf-8",
    }
    for name, content_type in types.items():
        f = await client.get(f"/room/static/{name}")
        assert f.status_code == 200, (name, f.text)
        assert f.headers["Content-Type"] == content_type
        assert f.headers["Cache-Control"].startswith("public, max-age=")
        strict(f)
        assert b"://" not in f.content.replace(b"http://", b"").replace(b"https://", b""), name
    page_js = (await client.get("/room/static/page.js")).text
    # The buyer's token goes only in a header, to the gate's own paths.
    assert "Authorization" in page_js and "history.replaceState" in page_js
    assert "fetch(path" in page_js and 'new Worker("/room/static/pow.js")' in page_js
    assert "crypto.subtle.digest" in (await client.get("/room/static/pow.js")).text
    for name in ("index.html", "nope.js", "..%2Fpage.py", "page.js.map"):
        problem(await client.get(f"/room/static/{name}"), 404, "NOT_FOUND")


async def test_the_config_read_gives_the_rooms_return_origins(client: Client) -> None:
    deal_id = await create_deal(
        client,
        title="Lantern 灯笼",
        stock=5,
        waiting_room=room(return_origins=[SHOP, "http://127.0.0.1:8123"], access="codes"),
    )
    r = await client.get(f"/room/{deal_id}/config")
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.headers["Cache-Control"] == "no-store"
    strict(r)
    assert r.json() == {
        "deal_id": deal_id,
        "title": "Lantern 灯笼",
        "return_origins": [SHOP, "http://127.0.0.1:8123"],
        "access": "codes",
        "page": None,
    }
    # A room without return origins: the page is served, and refuses every return.
    bare = await create_deal(client, stock=5, waiting_room={"admit_per_second": 10})
    assert (await client.get(f"/room/{bare}")).status_code == 200
    assert (await client.get(f"/room/{bare}/config")).json()["return_origins"] == []


async def test_unknown_deals_and_deals_without_a_room_are_404(client: Client) -> None:
    plain = await create_deal(client, stock=5)
    for path in (f"/room/{plain}", f"/room/{plain}/config"):
        problem(await client.get(path), 404, "NOT_FOUND")
    for deal in ("0", str(2**62 + 7), str(2**63), "9" * 40, "-1", "abc"):
        for path in (f"/room/{deal}", f"/room/{deal}/config"):
            problem(await client.get(path), 404, "NOT_FOUND")
    # A room removed: its page goes with it.
    deal_id = await create_deal(client, stock=5, waiting_room=room())
    assert (await client.get(f"/room/{deal_id}")).status_code == 200
    r = await client.put(
        f"/v1/admin/deals/{deal_id}/waiting-room",
        content=b"null",
        headers={**ADMIN, "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    # The page reads the deal as buyers' reads do: at most about a second old.
    gone = await eventually(client, f"/room/{deal_id}", lambda g: g.status_code == 404)
    problem(gone, 404, "NOT_FOUND")
    r = await client.post(f"/room/{deal_id}", json={}, headers=ADMIN)
    problem(r, 405, "METHOD_NOT_ALLOWED")


BAD_ORIGINS: list[Any] = [
    "http://shop.example",  # http only for loopback names
    "https://shop.example/",
    "https://shop.example/return",
    "https://shop.example?x=1",
    "https://shop.example#x",
    "https://user@shop.example",
    "shop.example",
    "//shop.example",
    "https://",
    "https://shop.example:0",
    "https://shop.example:65536",
    "https://shop.example:",
    "https://*.example",
    "https://shop_example.com",
    "https://-shop.example",
    "https://shop..example",
    "https://shöp.example",
    "https://shop.example ",
    "ftp://shop.example",
    "javascript:alert(1)",
    "data:text/html,x",
    "https://" + "a" * 95 + ".com",
    "",
    1,
    None,
    ["https://shop.example"],
]


@pytest.mark.parametrize("bad", BAD_ORIGINS, ids=[repr(b)[:30] for b in BAD_ORIGINS])
async def test_a_bad_return_origin_is_a_400_that_changes_nothing(client: Client, bad: Any) -> None:
    r = await client.post(
        "/v1/admin/deals",
        json={
            "title": "t",
            "unit_price": 1,
            "currency": "EUR",
            "stock": 1,
            "waiting_room": room(return_origins=[SHOP, bad]),
        },
        headers=ADMIN,
    )
    problem(r, 400, "INVALID_REQUEST")
    assert "return_origins[1]" in r.json()["detail"]
    deal_id = await create_deal(client, stock=1, waiting_room=room())
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    problem(
        await client.put(path, json=room(return_origins=[bad]), headers=ADMIN),
        400,
        "INVALID_REQUEST",
    )
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["return_origins"] == [SHOP]


async def test_return_origins_bounds_and_the_form_they_are_kept_in(client: Client) -> None:
    for bad in ("https://shop.example", {"a": 1}, [SHOP] * 17):
        r = await client.post(
            "/v1/admin/deals",
            json={"title": "t", "unit_price": 1, "currency": "EUR", "stock": 1}
            | {"waiting_room": room(return_origins=bad)},
            headers=ADMIN,
        )
        problem(r, 400, "INVALID_REQUEST")
    # Kept as a browser's URL.origin writes them: lowercase, no default port, once.
    given = [
        "HTTPS://Shop.Example:443",
        SHOP,
        "https://shop.example:8443",
        "http://localhost:8080",
        "http://127.0.0.1:80",
        "http://[::1]:9000",
        "https://203.0.113.9",
        "https://xn--shp-sna.example",
    ]
    deal_id = await create_deal(client, stock=1, waiting_room=room(return_origins=given))
    kept = [
        SHOP,
        "https://shop.example:8443",
        "http://localhost:8080",
        "http://127.0.0.1",
        "http://[::1]:9000",
        "https://203.0.113.9",
        "https://xn--shp-sna.example",
    ]
    view = (await client.get(f"/v1/admin/deals/{deal_id}", headers=ADMIN)).json()
    assert view["waiting_room"]["return_origins"] == kept
    r = await eventually(client, f"/room/{deal_id}/config", lambda g: g.status_code == 200)
    assert r.json()["return_origins"] == kept
    # Sixteen long origins fit; with the longest message of escaped characters the
    # room would not fit its column: a 400, nothing changed.
    many = [f"https://{i:02d}" + "a" * 80 + ".example" for i in range(16)]
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    r = await client.put(path, json=room(return_origins=many), headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["waiting_room"]["return_origins"] == many
    long_message = {"text": "🚪" * 280, "level": "warning"}
    # Sent as UTF-8 (within the body's 4 KiB); stored with every emoji escaped.
    r = await client.put(
        path,
        content=orjson.dumps(room(return_origins=many, message=long_message)),
        headers={**ADMIN, "Content-Type": "application/json"},
    )
    problem(r, 400, "INVALID_REQUEST")
    r = await eventually(
        client, f"/room/{deal_id}/config", lambda g: g.json()["return_origins"] == many
    )
    assert r.json()["return_origins"] == many
    # null, [] or absent: none (the admin view then leaves the field out).
    for none in (None, []):
        r = await client.put(path, json=room(return_origins=none), headers=ADMIN)
        assert r.status_code == 200, r.text
        assert "return_origins" not in r.json()["waiting_room"], r.text
        r = await eventually(
            client, f"/room/{deal_id}/config", lambda g: g.json()["return_origins"] == []
        )
        assert r.json()["return_origins"] == []


@pytest.mark.slow
async def test_pages_of_unknown_deals_stay_off_the_database(
    counted_gate: tuple[GateProcess, StatementCounter],  # noqa: F811
    settings: Settings,
) -> None:
    floor = await _highest_deal_id(settings) + 1_000_000
    rng = random.Random(17)
    client = Client(counted_gate[0].url)
    try:

        async def send(i: int) -> Resp:
            tail = "/config" if i % 2 else ""
            return await client.get(f"/room/{rng.randrange(floor, 2**62)}{tail}")

        assert await _per_request(counted_gate[1], send, 404) <= 0.05
    finally:
        await client.close()
