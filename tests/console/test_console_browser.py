"""The console in a real headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium; nothing is downloaded): sign in, watch a deal's numbers move
under load, rebucket and add stock from the page and see the buckets and the ledger
change, CSRF refused, sign out; accessibility basics. Screenshots of the live view
go to the test's temporary folder (and the README's to docs/img/console.png)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from tests.browser_support import browser, confirm, text_of, until
from tests.console_support import console_env
from tests.support import (
    ADMIN_TOKEN,
    ROOT,
    Client,
    GateProcess,
    Traffic,
    assert_invariants,
    create_deal,
    db_available,
    running_gate,
)


@pytest.fixture(scope="module")
def browser_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    # Two workers: the page's polls land on either; each has its own snapshot.
    with running_gate(console_env(env), workers=2) as proc:
        yield proc


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with browser() as d:
        yield d


def _num(driver: Any, element_id: str) -> int | None:
    t = text_of(driver, element_id)
    return int(t) if t.lstrip("-").isdigit() else None


def _fill_and_confirm(driver: Any, fields: dict[str, str], form_id: str) -> None:
    from selenium.webdriver.common.by import By

    for field_id, value in fields.items():
        box = driver.find_element(By.ID, field_id)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.CSS_SELECTOR, f"#{form_id} button[type=submit]").click()


async def test_console_in_a_real_browser(
    driver: Any,
    browser_gate: GateProcess,
    db: Database,
    rds: aioredis.Redis,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    client = Client(browser_gate.url)
    shots = tmp_path / "screenshots"
    shots.mkdir()
    try:
        deal_id = await create_deal(client, title="Console lamp", stock=5000, buckets=2)
        await asyncio.to_thread(driver.get, browser_gate.url + "/console")

        # Accessibility basics: every input and button has a label; the sign-in form is
        # reachable by keyboard alone; text and buttons have readable contrast.
        unlabeled = await asyncio.to_thread(
            driver.execute_script,
            """return [...document.querySelectorAll('input, button, select, textarea')]
                 .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                              && !e.textContent.trim())
                 .map(e => e.id || e.outerHTML);""",
        )
        assert unlabeled == []
        contrast = await asyncio.to_thread(driver.execute_script, CONTRAST_JS)
        assert contrast and min(c[1] for c in contrast) >= 4.5, contrast
        body = driver.find_element(By.TAG_NAME, "body")
        await asyncio.to_thread(body.send_keys, Keys.TAB)  # the skip link
        await asyncio.to_thread(lambda: driver.switch_to.active_element.send_keys(Keys.TAB))
        focused = await asyncio.to_thread(
            lambda: driver.switch_to.active_element.get_attribute("id")
        )
        assert focused == "token"

        # A wrong token is refused and nothing is shown.
        await asyncio.to_thread(
            _fill_and_confirm, driver, {"token": "not-the-token-000000"}, "signin-form"
        )
        await until(lambda: "Wrong admin token" in text_of(driver, "signin-error"), "the refusal")
        assert not driver.find_element(By.ID, "console").is_displayed()

        # Sign in with the keyboard: type the token, Enter.
        token_box = driver.find_element(By.ID, "token")
        await asyncio.to_thread(token_box.clear)
        await asyncio.to_thread(token_box.send_keys, ADMIN_TOKEN + Keys.ENTER)
        await until(lambda: driver.find_element(By.ID, "console").is_displayed(), "the console")
        cookies = {c["name"]: c for c in driver.get_cookies()}
        session = cookies["gate_console"]
        assert session["httpOnly"] and session["sameSite"] == "Strict"
        # HttpOnly: the page's script cannot read it.
        readable = await asyncio.to_thread(driver.execute_script, "return document.cookie")
        assert "gate_console" not in readable

        pick = await until(
            lambda: driver.find_element(
                By.CSS_SELECTOR, f'#deals tr[data-deal="{deal_id}"] button.pick'
            ),
            "the deal in the list",
        )
        await asyncio.to_thread(pick.click)
        await until(lambda: _num(driver, "n-available") == 5000, "the deal's numbers")

        # The list refreshes every second in place: a focused control keeps its focus.
        await asyncio.to_thread(driver.execute_script, "arguments[0].focus()", pick)
        await asyncio.sleep(2.5)
        still = await asyncio.to_thread(
            driver.execute_script,
            "const e = document.activeElement;"
            " return e && e.classList.contains('pick') ? e.closest('tr').dataset.deal : null",
        )
        assert still == str(deal_id)

        # Numbers move while a load runs.
        traffic = Traffic(client, deal_id, user_base=880_000, seed=19)
        traffic.start(buyers=6)
        try:
            await until(
                lambda: (
                    (_num(driver, "n-held") or 0) >= 20
                    and (_num(driver, "n-available") or 5000) <= 4980
                ),
                "held units to rise on the page",
            )
            await until(
                lambda: text_of(driver, "r-created") not in ("–", "0", "0.0"),
                "a reservation rate on the page",
            )
            await asyncio.sleep(2.5)  # a few points on the chart
            await asyncio.to_thread(driver.save_screenshot, str(shots / "live.png"))
        finally:
            await traffic.finish()
        points = await asyncio.to_thread(
            driver.execute_script,
            "return document.querySelector('#chart polyline')"
            ".getAttribute('points').split(' ').length",
        )
        assert points >= 3

        # Rebucket from the page: confirm, see the bars and the ledger change.
        await asyncio.to_thread(_fill_and_confirm, driver, {"bucket-count": "5"}, "buckets-form")
        await until(lambda: confirm(driver), "the confirmation dialog")
        await until(lambda: "Done: buckets" in text_of(driver, "action-result"), "the rebucket")
        await until(
            lambda: len(driver.find_elements(By.CSS_SELECTOR, "#bars .bar")) == 5, "five bars"
        )
        assert len(await db_available(db, deal_id)) == 5
        await until(
            lambda: any(
                "rebucket" in r.text and "console:" in r.text and "buckets 2 -> 5" in r.text
                for r in driver.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")
            ),
            "the rebucket in the page's ledger",
            on_timeout=lambda: [
                r.text for r in driver.find_elements(By.CSS_SELECTOR, "#ledger tr")
            ][:8],
        )
        rows = await db.fetchall(
            "SELECT actor FROM inventory_ledger WHERE deal_id = %s AND reason = 'rebucket'",
            (deal_id,),
        )
        assert rows and all(str(r[0]).startswith("console:") for r in rows)

        # A cancelled confirmation changes nothing.
        await asyncio.to_thread(_fill_and_confirm, driver, {"bucket-count": "7"}, "buckets-form")
        await until(lambda: driver.find_element(By.ID, "confirm").get_attribute("open"), "dialog")
        await asyncio.to_thread(lambda: driver.find_element(By.ID, "confirm-cancel").click())
        await until(lambda: text_of(driver, "action-result") == "Cancelled.", "the cancel")
        assert len(await db_available(db, deal_id)) == 5

        # Add stock with a reason.
        before_total = sum(
            int(r[0])
            for r in await db.fetchall(
                "SELECT total FROM deal_buckets WHERE deal_id = %s", (deal_id,)
            )
        )
        await asyncio.to_thread(
            _fill_and_confirm,
            driver,
            {"stock-delta": "50", "stock-reason": "second pallet"},
            "stock-form",
        )
        await until(lambda: confirm(driver), "the confirmation dialog")
        await until(lambda: "Done: stock" in text_of(driver, "action-result"), "the stock change")
        await until(lambda: _num(driver, "n-total") == before_total + 50, "the new total")
        adjust = await db.fetchall(
            "SELECT SUM(d_total), MIN(actor), MIN(note) FROM inventory_ledger"
            " WHERE deal_id = %s AND reason = 'adjust'",
            (deal_id,),
        )
        assert int(adjust[0][0]) == 50 and str(adjust[0][1]).startswith("console:")
        assert adjust[0][2] == "second pallet"
        await asyncio.to_thread(driver.save_screenshot, str(shots / "after-actions.png"))
        # The README's picture is refreshed on request only (the tree stays clean):
        #   CONSOLE_README_SCREENSHOT=1 pytest tests/console/test_console_browser.py
        if os.environ.get("CONSOLE_README_SCREENSHOT") == "1":
            (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shots / "live.png", ROOT / "docs" / "img" / "console.png")

        # A state-changing request without the CSRF token, from the signed-in page.
        status = await asyncio.to_thread(
            driver.execute_async_script,
            """const done = arguments[arguments.length - 1];
               fetch('/console/api/deals/%d/buckets', {method: 'POST', credentials: 'same-origin',
                 headers: {'Content-Type': 'application/json'}, body: '{"count": 1}'})
                 .then(r => done(r.status));""".replace("%d", str(deal_id)),
        )
        assert status == 403
        assert len(await db_available(db, deal_id)) == 5

        # Sign out: back to the form, and the session is dead for every request.
        await asyncio.to_thread(lambda: driver.find_element(By.ID, "sign-out").click())
        await until(lambda: driver.find_element(By.ID, "signin").is_displayed(), "the sign-in form")
        status = await asyncio.to_thread(
            driver.execute_async_script,
            """const done = arguments[arguments.length - 1];
               fetch('/console/api/snapshot', {credentials: 'same-origin'})
                 .then(r => done(r.status));""",
        )
        assert status == 401
        assert (shots / "live.png").stat().st_size > 10_000
        await assert_invariants(db, rds, deal_id)
    finally:
        await client.close()


# The contrast ratio (WCAG 2) of each text element's colour against the nearest
# opaque background, for the page's text, labels and buttons.
CONTRAST_JS = """
function lum(c) {
  const m = c.match(/\\d+(\\.\\d+)?/g).map(Number);
  const ch = m.slice(0, 3).map(v => {
    v /= 255;
    return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
  });
  return 0.2126 * ch[0] + 0.7152 * ch[1] + 0.0722 * ch[2];
}
function bg(e) {
  while (e) {
    const c = getComputedStyle(e).backgroundColor;
    if (c && c !== 'transparent' && !c.startsWith('rgba(0, 0, 0, 0)')) return c;
    e = e.parentElement;
  }
  return 'rgb(255, 255, 255)';
}
const out = [];
for (const e of document.querySelectorAll('h1, h2, label, button, p, th, caption, a')) {
  const a = lum(getComputedStyle(e).color), b = lum(bg(e));
  out.push([e.id || e.tagName, (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)]);
}
return out;
"""
