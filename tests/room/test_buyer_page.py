"""The buyer page in a real headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium offline, as tests/console/test_console_browser.py does), against a
real gate process, Redis and MariaDB, with a "shop" on loopback that records every
request it gets:

    shop link ──> /room/{deal}#token=…&return=http://127.0.0.1:<shop>/return?order=7
    page: proof of work in its Web Worker, join, wait (position, ETA, progress, the
          room's message as it changes), admitted ──> the shop's page
          #admission_token=…, which the gate takes for a reservation (201)

and: a sold-out room shown as such, the page in Simplified Chinese for a zh-CN
browser, a return address outside the room's return_origins refused on the page (no
join, nothing sent to it), the fragment gone from the address bar and never in a
request either server saw, no CSP violation in the browser's log."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest
import redis.asyncio as aioredis

from gate.room.gates import solve
from gate.store.db import Database
from tests.browser_support import browser, chromium, until
from tests.png_support import data_url, decode, make
from tests.room.chance_support import evidence
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    assert_invariants,
    buyer,
    create_deal,
    free_port,
    running_gate,
    token,
)

SHOP_PAGE = b"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>Shop</title></head><body><h1 id="shop">The shop</h1></body></html>"""


class Shop:
    """A shop on loopback: answers every GET with a small page and records the
    request line and headers (the fragment never reaches a server)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.origin = f"http://127.0.0.1:{self.port}"
        self.requests: list[tuple[str, dict[str, str]]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(SHOP_PAGE)))
                self.end_headers()
                self.wfile.write(SHOP_PAGE)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def page_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    # Short poll advice: the page moves within a fraction of a second of each change.
    env = {**env, "GATE_ROOM_POLL_MIN_MS": "200", "GATE_ROOM_POLL_MAX_MS": "1000"}
    with running_gate(env, workers=1) as proc:
        yield proc


@pytest.fixture(scope="module")
def shop() -> Iterator[Shop]:
    s = Shop()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with browser("en-US", window="900,900") as d:
        yield d


@pytest.fixture
async def pc(page_gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(page_gate.url) as client:
        yield client


def room(shop: Shop, **more: Any) -> dict[str, Any]:
    return {
        "admit_per_second": 50,
        "admission_ttl_seconds": 3600,
        "return_origins": ["https://shop.example", shop.origin],
        "challenge": {"min_bits": 8, "max_bits": 8},
        **more,
    }


def link(gate: GateProcess, deal_id: int, buyer_token: str, return_to: str) -> str:
    return (
        f"{gate.url}/room/{deal_id}#token={quote(buyer_token, safe='')}"
        f"&return={quote(return_to, safe='')}"
    )


async def ticket_until(client: Client, deal_id: int, user_id: int, state: str) -> dict[str, Any]:
    """The buyer's ticket once it reads `state` (polled as advised), at most 20 s."""
    path = f"/v1/deals/{deal_id}/queue"
    for _ in range(200):
        r = await client.get(path, headers=buyer(user_id))
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            if body["state"] == state:
                return body
            await asyncio.sleep(body["poll_after_ms"] / 1000)
        else:
            assert r.status_code == 429, r.text
            await asyncio.sleep(0.2)
    raise AssertionError(f"buyer {user_id} never reached {state}")


async def api_join(client: Client, deal_id: int, user_id: int) -> dict[str, Any]:
    """A buyer joined through the API, with a solved challenge."""
    c = await client.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(user_id))
    assert c.status_code == 200, c.text
    proof = {"challenge": c.json()["challenge"], "nonce": solve(c.json()["challenge"], 8)}
    r = await client.post(f"/v1/deals/{deal_id}/queue", json=proof, headers=buyer(user_id))
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def shown(driver: Any) -> dict[str, Any]:
    """What the page shows, in one script call (its elements are rewritten live)."""
    return dict(
        driver.execute_script(
            """const $ = (id) => document.getElementById(id);
               return {
                 state: $('state').dataset.state || '', stateText: $('state').textContent,
                 position: $('numbers').hidden ? null : $('position').textContent,
                 eta: $('eta').textContent, progress: $('progress').value,
                 progressShown: !$('progress').hidden,
                 message: $('message').hidden ? null : $('message').textContent,
                 level: $('message').dataset.level || null,
                 error: $('error').hidden ? null : $('error').dataset.error,
                 errorText: $('error').textContent,
                 lang: document.documentElement.lang, title: document.title,
                 live: $('status').getAttribute('aria-live'),
                 url: location.href };"""
        )
    )


def csp_violations(driver: Any) -> list[str]:
    return [
        str(e["message"])
        for e in driver.get_log("browser")
        if "Content Security Policy" in str(e["message"])
    ]


async def on_page(driver: Any, check: Callable[[dict[str, Any]], bool], what: str) -> Any:
    return await until(
        lambda: (lambda s: s if check(s) else None)(shown(driver)),
        what,
        lambda: shown(driver),
    )


async def test_join_wait_admitted_and_back_to_the_shop_with_the_token(
    driver: Any,
    page_gate: GateProcess,
    pc: Client,
    shop: Shop,
    db: Database,
    rds: aioredis.Redis,
) -> None:
    deal_id = await create_deal(pc, title="Lantern", stock=1, waiting_room=room(shop))
    # A holds the one unit's admission, B waits first: the page's buyer C is second.
    await api_join(pc, deal_id, 7_300_001)
    await ticket_until(pc, deal_id, 7_300_001, "admitted")
    assert (await api_join(pc, deal_id, 7_300_002))["position"] == 1
    user_c = 7_300_003
    buyer_token = token(user_c)
    return_to = f"{shop.origin}/return?order=7"
    await asyncio.to_thread(driver.get, link(page_gate, deal_id, buyer_token, return_to))

    seen = await on_page(driver, lambda s: s["state"] == "waiting", "C waiting on the page")
    assert seen["position"] == "2" and seen["eta"], seen
    assert seen["progress"] == 0 and seen["progressShown"], seen
    assert seen["live"] == "polite" and seen["lang"] == "en"
    assert seen["title"] == "Waiting room" and seen["stateText"] == "You are in line."
    # The fragment is gone from the address bar (and from history) once read.
    assert "#" not in seen["url"] and buyer_token not in seen["url"], seen["url"]
    assert (await ticket_until(pc, deal_id, user_c, "waiting"))["position"] == 2

    # The room's message appears, then changes, on the page's next polls.
    path = f"/v1/admin/deals/{deal_id}/waiting-room"
    said = {"text": "Doors open soon: stay on this page.", "level": "info"}
    r = await pc.put(path, json=room(shop, message=said), headers=ADMIN)
    assert r.status_code == 200, r.text
    seen = await on_page(driver, lambda s: s["message"] == said["text"], "the message")
    assert seen["level"] == "info"
    warned = {"text": "Only a few lanterns left.", "level": "warning"}
    r = await pc.put(path, json=room(shop, message=warned), headers=ADMIN)
    assert r.status_code == 200, r.text
    seen = await on_page(driver, lambda s: s["message"] == warned["text"], "the new message")
    assert seen["level"] == "warning" and seen["state"] == "waiting"

    # One unit more: B is admitted, C moves to the front and the bar moves on.
    stock = f"/v1/admin/deals/{deal_id}/stock"
    r = await pc.post(stock, json={"delta": 1, "reason": "more"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    seen = await on_page(driver, lambda s: s["position"] == "1", "C at the front")
    assert seen["progress"] == 50, seen
    assert [p for p, _ in shop.requests if p != "/favicon.ico"] == []

    # Another: C is admitted and lands on the shop's page with the admission token.
    r = await pc.post(stock, json={"delta": 1, "reason": "more"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    landed = await until(
        lambda: driver.current_url if driver.current_url.startswith(shop.origin) else None,
        "the shop's page",
        lambda: shown(driver),
    )
    parts = urlsplit(landed)
    assert f"{parts.scheme}://{parts.netloc}{parts.path}?{parts.query}" == return_to
    fragment = parse_qs(parts.fragment)
    assert list(fragment) == ["admission_token"], parts.fragment
    admission = fragment["admission_token"][0]
    # What the shop's server got: the return address, nothing of either token, no
    # referrer (the page's policy).
    # (The browser may ask the shop for its icon too.)
    got = [(p, h) for p, h in shop.requests if p != "/favicon.ico"]
    assert [p for p, _ in got] == ["/return?order=7"]
    headers = got[0][1]
    assert "referer" not in headers and "authorization" not in headers
    assert all(admission not in v and buyer_token not in v for v in headers.values())

    # The shop reserves with it: the gate takes it, once.
    reserve = {**buyer(user_c), "Idempotency-Key": "page-c-0001", "Admission-Token": admission}
    r = await pc.post(f"/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=reserve)
    assert r.status_code == 201, r.text
    again = {**reserve, "Idempotency-Key": "page-c-0002"}
    r = await pc.post(f"/v1/deals/{deal_id}/reservations", json={"quantity": 1}, headers=again)
    assert r.status_code == 403 and r.json()["code"] == "ADMISSION_INVALID", r.text
    await assert_invariants(db, rds, deal_id)
    # Neither token ever reached the gate in a URL (its log names every bad request).
    log = page_gate.output()
    assert buyer_token not in log and admission not in log
    assert "Traceback" not in log
    assert csp_violations(driver) == []


async def test_a_sold_out_room_is_shown_as_such(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    deal_id = await create_deal(pc, title="Gone", stock=0, waiting_room=room(shop))
    url = link(page_gate, deal_id, token(7_300_101), f"{shop.origin}/return")
    await asyncio.to_thread(driver.get, url)
    seen = await on_page(driver, lambda s: s["state"] == "sold_out", "sold out")
    assert seen["stateText"].startswith("Sold out"), seen
    assert seen["position"] is None and seen["error"] is None
    assert (await ticket_until(pc, deal_id, 7_300_101, "sold_out"))["position"] is None
    assert not [p for p, _ in shop.requests if p == "/return"]
    assert csp_violations(driver) == []


async def test_the_buyer_leaves_the_line_and_joins_again_at_the_back(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    """The page's "Leave the line" (DELETE …/queue): the ticket is gone, the buyer
    behind moves up; "Join the line again" makes a new ticket behind them."""
    deal_id = await create_deal(pc, title="Kite", stock=1, waiting_room=room(shop))
    # A holds the one unit's admission: the page's buyer C waits first, B behind.
    await api_join(pc, deal_id, 7_300_301)
    await ticket_until(pc, deal_id, 7_300_301, "admitted")
    c, b = 7_300_302, 7_300_303
    await asyncio.to_thread(driver.get, link(page_gate, deal_id, token(c), f"{shop.origin}/r"))
    await on_page(driver, lambda s: s["state"] == "waiting" and s["position"] == "1", "waiting")
    await api_join(pc, deal_id, b)
    label = await asyncio.to_thread(
        driver.execute_script,
        "const e = document.getElementById('leave');"
        " return [e.textContent, e.offsetParent !== null];",
    )
    assert label == ["Leave the line", True], label

    await asyncio.to_thread(driver.execute_script, "document.getElementById('leave').click()")
    seen = await on_page(driver, lambda s: s["state"] == "left", "left")
    assert seen["stateText"].startswith("You have left the line"), seen
    assert seen["position"] is None and seen["error"] is None
    r = await pc.get(f"/v1/deals/{deal_id}/queue", headers=buyer(c))
    assert r.status_code == 404 and r.json()["code"] == "NO_TICKET", r.text
    assert (await ticket_until(pc, deal_id, b, "waiting"))["position"] == 1

    await asyncio.to_thread(driver.execute_script, "document.getElementById('rejoin').click()")
    await on_page(driver, lambda s: s["state"] == "waiting" and s["position"] == "2", "rejoined")
    assert (await ticket_until(pc, deal_id, c, "waiting"))["position"] == 2
    assert csp_violations(driver) == []


ACCENT = (138, 28, 28)  # #8a1c1c: 7.9:1 on white
LOGO_RGB = (20, 90, 200)


def _near(pixel: tuple[int, int, int], rgb: tuple[int, int, int]) -> bool:
    return all(abs(a - b) <= 2 for a, b in zip(pixel, rgb, strict=True))


async def test_a_branded_room_shows_the_shops_name_colour_logo_and_help(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    """The room's page object on the page, read back from the DOM and from the pixels
    of a screenshot: the accent colour on the button, the logo drawn, the name as text
    (never markup), within the page's CSP (no violation, nothing from another origin)."""
    page = {
        "shop_name": "Lantern <b>& Kite</b>",
        "accent_color": "#8A1C1C",
        "logo": data_url(make(96, 48, LOGO_RGB)),
        "help_url": "https://shop.example/help",
    }
    deal_id = await create_deal(pc, title="Kite", stock=0, waiting_room=room(shop, page=page))
    url = link(page_gate, deal_id, token(7_300_401), f"{shop.origin}/return")
    await asyncio.to_thread(driver.get, url)
    await on_page(driver, lambda s: s["state"] == "sold_out", "sold out")
    dom = await until(
        lambda: driver.execute_script(
            """const $ = (id) => document.getElementById(id);
               const img = $('logo');
               if (!img.complete || img.naturalWidth === 0) return null;
               const button = getComputedStyle($('leave'));
               return {
                 name: $('shop-name').textContent,
                 nameElements: $('shop-name').children.length,
                 brand: document.documentElement.dataset.brand || null,
                 background: button.backgroundColor, color: button.color,
                 link: getComputedStyle($('help')).color,
                 logo: [img.naturalWidth, img.naturalHeight, img.src.slice(0, 22)],
                 help: $('help').href, helpShown: !$('help-row').hidden,
                 body: getComputedStyle(document.body).backgroundColor };"""
        ),
        "the logo drawn",
    )
    assert dom["name"] == "Lantern <b>& Kite</b>" and dom["nameElements"] == 0, dom
    assert dom["brand"] == "1"
    assert dom["background"] == "rgb(138, 28, 28)" and dom["color"] == "rgb(255, 255, 255)"
    assert dom["link"] == "rgb(138, 28, 28)"
    assert dom["logo"] == [96, 48, "data:image/png;base64,"], dom
    assert dom["help"] == "https://shop.example/help" and dom["helpShown"]
    assert dom["body"] == "rgb(255, 255, 255)"

    shot = await asyncio.to_thread(driver.get_screenshot_as_png)
    width, _, pixels = decode(shot)
    box = await asyncio.to_thread(
        driver.execute_script,
        """const r = document.getElementById('leave').getBoundingClientRect();
           return [r.left, r.top, r.width, r.height, window.devicePixelRatio];""",
    )
    left, top, w, h, ratio = box
    # The button's own pixels are the accent (its text white), and the page's
    # background white.
    inside = [
        pixels[int(y * ratio) * width + int(x * ratio)]
        for y in range(int(top) + 2, int(top + h) - 2)
        for x in range(int(left) + 2, int(left + w) - 2)
    ]
    accent_share = sum(_near(p, ACCENT) for p in inside) / len(inside)
    assert accent_share > 0.6, accent_share
    assert sum(_near(p, LOGO_RGB) for p in pixels) >= 96 * 48 * 0.9
    assert _near(pixels[5 * width + 5], (255, 255, 255)), pixels[5 * width + 5]
    assert csp_violations(driver) == []


async def test_the_page_speaks_simplified_chinese_to_a_zh_cn_browser(
    page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    zh = await asyncio.to_thread(chromium, "zh-CN", "900,900")
    try:
        languages = await asyncio.to_thread(zh.execute_script, "return navigator.languages")
        assert languages[0] == "zh-CN", languages
        gone = await create_deal(pc, title="灯笼", stock=0, waiting_room=room(shop))
        url = link(page_gate, gone, token(7_300_201), f"{shop.origin}/return")
        await asyncio.to_thread(zh.get, url)
        seen = await on_page(zh, lambda s: s["state"] == "sold_out", "售罄")
        assert seen["lang"] == "zh-CN" and seen["title"] == "排队等候", seen
        assert seen["stateText"].startswith("暂时售罄"), seen
        heading = await asyncio.to_thread(
            zh.execute_script, "return document.getElementById('heading').textContent"
        )
        assert heading == "排队等候"
        # Waiting, in Chinese: position and an ETA in its words.
        open_deal = await create_deal(pc, stock=1, waiting_room=room(shop))
        await api_join(pc, open_deal, 7_300_202)
        await ticket_until(pc, open_deal, 7_300_202, "admitted")
        url = link(page_gate, open_deal, token(7_300_203), f"{shop.origin}/return")
        await asyncio.to_thread(zh.get, url)
        seen = await on_page(zh, lambda s: s["state"] == "waiting", "排队中")
        assert seen["stateText"] == "您已在队列中。" and seen["position"] == "1", seen
        assert seen["eta"].endswith("秒") or "分钟" in seen["eta"], seen
        leave = await asyncio.to_thread(
            zh.execute_script, "return document.getElementById('leave').textContent"
        )
        assert leave == "离开队列"
        # A refused return address, in Chinese too.
        url = link(page_gate, open_deal, token(7_300_204), "https://evil.example/")
        await asyncio.to_thread(zh.get, "about:blank")
        await asyncio.to_thread(zh.get, url)
        seen = await on_page(zh, lambda s: s["error"] == "err_return", "拒绝")
        assert "返回地址" in seen["errorText"], seen
        assert csp_violations(zh) == []
    finally:
        await asyncio.to_thread(zh.quit)


async def test_a_return_address_outside_return_origins_gets_nothing(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    deal_id = await create_deal(pc, stock=5, waiting_room=room(shop))
    bare = await create_deal(pc, stock=5, waiting_room={"admit_per_second": 50})
    cases = [
        (deal_id, "https://evil.example/return"),
        (deal_id, f"{shop.origin}.evil.example/return"),
        (deal_id, f"http://localhost:{shop.port}/return"),  # another origin, same server
        (deal_id, "https://shop.example:444/"),
        (deal_id, "javascript:alert(1)//https://shop.example"),
        (deal_id, "/return"),
        (deal_id, ""),
        # A room without return_origins: every address refused.
        (bare, f"{shop.origin}/return"),
    ]

    def asked() -> list[str]:
        return [p for p, _ in shop.requests if p != "/favicon.ico"]

    before = asked()
    for n, (deal, return_to) in enumerate(cases):
        user = 7_300_300 + n
        await asyncio.to_thread(driver.get, "about:blank")
        await asyncio.to_thread(driver.get, link(page_gate, deal, token(user), return_to))
        seen = await on_page(driver, lambda s: s["error"] == "err_return", f"refusal {n}")
        assert seen["url"] == f"{page_gate.url}/room/{deal}", seen
        assert "not one the shop has registered" in seen["errorText"]
        # Refused before joining: the buyer has no ticket, the address got nothing.
        r = await pc.get(f"/v1/deals/{deal}/queue", headers=buyer(user))
        assert r.status_code == 404 and r.json()["code"] == "NO_TICKET", (return_to, r.text)
    # An allowed address but no token: nothing is asked of the gate either.
    await asyncio.to_thread(driver.get, "about:blank")
    await asyncio.to_thread(driver.get, f"{page_gate.url}/room/{deal_id}#return={shop.origin}")
    seen = await on_page(driver, lambda s: s["error"] == "err_token", "no token")
    assert asked() == before
    assert csp_violations(driver) == []


async def test_an_invite_only_room_asks_for_the_access_code(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop
) -> None:
    from selenium.webdriver.common.by import By

    deal_id = await create_deal(pc, stock=5, waiting_room=room(shop, access="codes"))
    r = await pc.post(
        f"/v1/admin/deals/{deal_id}/access-codes",
        json={"codes": ["invite-page-0001", "invite-page-0002"]},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    # Another buyer holds the second code already.
    c = await pc.get(f"/v1/deals/{deal_id}/queue/challenge", headers=buyer(7_300_401))
    proof = {"challenge": c.json()["challenge"], "nonce": solve(c.json()["challenge"], 8)}
    r = await pc.post(
        f"/v1/deals/{deal_id}/queue",
        json={**proof, "access_code": "invite-page-0002"},
        headers=buyer(7_300_401),
    )
    assert r.status_code == 201, r.text
    user = 7_300_402
    await asyncio.to_thread(driver.get, "about:blank")
    await asyncio.to_thread(
        driver.get, link(page_gate, deal_id, token(user), f"{shop.origin}/return?order=9")
    )
    await on_page(driver, lambda s: s["error"] == "code_required", "the code asked for")

    def enter(code: str) -> None:
        box = driver.find_element(By.ID, "code")
        box.clear()
        box.send_keys(code)
        driver.find_element(By.ID, "code-submit").click()

    for code, refusal in (("not-a-code-000", "code_invalid"), ("invite-page-0002", "code_used")):
        await asyncio.to_thread(enter, code)
        await on_page(driver, lambda s, want=refusal: s["error"] == want, refusal)
        r = await pc.get(f"/v1/deals/{deal_id}/queue", headers=buyer(user))
        assert r.status_code == 404 and r.json()["code"] == "NO_TICKET", r.text
    await asyncio.to_thread(enter, "invite-page-0001")
    landed = await until(
        lambda: driver.current_url if driver.current_url.startswith(shop.origin) else None,
        "the shop's page",
        lambda: shown(driver),
    )
    assert "#admission_token=" in landed
    assert csp_violations(driver) == []


async def test_an_unlikely_place_is_said_plainly_with_the_way_out(
    driver: Any, page_gate: GateProcess, pc: Client, shop: Shop, rds: aioredis.Redis
) -> None:
    """One unit, held by an admitted buyer, 30 buyers waiting ahead who mostly buy
    (the room's measured history): the page says the buyer is unlikely to get one,
    shows the chance, keeps the place and offers to leave."""
    deal_id = await create_deal(pc, title="Lamp", stock=1, waiting_room=room(shop))
    await api_join(pc, deal_id, 7_300_600)
    await ticket_until(pc, deal_id, 7_300_600, "admitted")
    for user in range(7_300_601, 7_300_631):
        await api_join(pc, deal_id, user)
    await evidence(rds, deal_id)
    me = 7_300_650
    await asyncio.to_thread(driver.get, link(page_gate, deal_id, token(me), f"{shop.origin}/r"))
    seen = await on_page(driver, lambda s: s["state"] == "unlikely", "unlikely")
    assert seen["stateText"].startswith("You are unlikely to get one"), seen
    assert seen["position"] is not None and seen["error"] is None
    extra = await asyncio.to_thread(
        driver.execute_script,
        "const $ = (id) => document.getElementById(id);"
        " return [$('chance-row').hidden, $('chance').textContent,"
        " $('leave').offsetParent !== null];",
    )
    assert extra == [False, "less than 1 %", True], extra
    assert (await ticket_until(pc, deal_id, me, "unlikely"))["chance"]["p"] < 0.02
    await asyncio.to_thread(driver.execute_script, "document.getElementById('leave').click()")
    await on_page(driver, lambda s: s["state"] == "left", "left")
    assert csp_violations(driver) == []
