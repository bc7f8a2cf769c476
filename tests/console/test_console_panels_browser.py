"""The console's waiting-room and queue-mode panels in a real headless Chromium
(Debian's chromium and chromium-driver through Selenium, offline, as
the other browser tests drive it): the numbers of a room with real joiners, the
room message edited from the page and carried by a buyer's ticket read, a dead
letter made for real and retried with the page's button."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.store.db import Database
from gate.store.keys import queue_keys
from tests.browser_support import browser, confirm, text_of, until
from tests.console_support import console_env
from tests.panels_support import (
    PANEL_ENV,
    dead_letters,
    join_with_proof,
    message_read_within,
    orders_refused,
    queued,
    quiet_room_deal,
    read_ticket,
    until_true,
)
from tests.support import (
    ADMIN_TOKEN,
    Client,
    GateProcess,
    assert_invariants,
    create_deal,
    running_gate,
)


@pytest.fixture(scope="module")
def panels_gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    env = console_env(env, **PANEL_ENV, GATE_QUEUE_RETRY_BASE_SECONDS="0.05")
    with running_gate(env, workers=1) as proc:
        yield proc


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with browser() as d:
        yield d


def _pick(driver: Any, deal_id: int) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'#deals tr[data-deal="{deal_id}"] button.pick')


def _shown(driver: Any, element_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return bool(driver.find_element(By.ID, element_id).is_displayed())


def _ledger_rows(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [str(r.text) for r in driver.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")]


async def test_room_and_queue_panels_in_a_real_browser(
    driver: Any,
    panels_gate: GateProcess,
    db: Database,
    rds: aioredis.Redis,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    client = Client(panels_gate.url)
    try:
        # A room of 2 units that admits nobody yet, six joiners through its challenge.
        room_deal = await quiet_room_deal(client, stock=2, low=1, high=20)
        joiners = range(160_001, 160_007)
        for user in joiners:
            await join_with_proof(client, room_deal, user)
        # A queue-mode deal with one dead letter: its commit refused until given up.
        queue_deal = await create_deal(client, title="Queued kettle", stock=5, mode="queue")
        async with orders_refused(db, queue_deal):
            await queued(client, queue_deal, 160_100, f"panels-browser-{queue_deal}")

            async def dead() -> bool:
                letters = await dead_letters(db, queue_deal)
                return len(letters) == 1 and await rds.xlen(queue_keys(queue_deal).stream) == 0

            await until_true(dead, "the dead letter")

        await asyncio.to_thread(driver.get, panels_gate.url + "/console")
        token_box = driver.find_element(By.ID, "token")
        await asyncio.to_thread(token_box.send_keys, ADMIN_TOKEN + Keys.ENTER)
        await until(lambda: _shown(driver, "console"), "the console")

        # The room's panel: six waiting, 1 + floor(log2(1 + 6 / 2)) = 3 bits, no message.
        pick = await until(lambda: _pick(driver, room_deal), "the room's deal in the list")
        await asyncio.to_thread(pick.click)
        await until(lambda: text_of(driver, "room-waiting") == "6", "six waiting")
        assert _shown(driver, "room-panel") and not _shown(driver, "queue-panel")
        assert text_of(driver, "room-bits") == "3"
        assert text_of(driver, "room-lapses") == "0"
        assert text_of(driver, "room-message") == "none"
        assert text_of(driver, "room-aps") == "5/s"
        # Every control of the panels has its label.
        unlabeled = await asyncio.to_thread(
            driver.execute_script,
            """return [...document.querySelectorAll('input, button, select, textarea')]
                 .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                              && !e.textContent.trim())
                 .map(e => e.id || e.outerHTML);""",
        )
        assert unlabeled == []

        # Edit the message from the page: confirmed, then a buyer's ticket read carries it.
        words = "Doors open at noon; keep this page open"
        box = driver.find_element(By.ID, "room-message-text")
        await asyncio.to_thread(box.send_keys, words)
        level = Select(driver.find_element(By.ID, "room-message-level"))
        await asyncio.to_thread(level.select_by_value, "warning")
        submit = driver.find_element(By.CSS_SELECTOR, "#room-message-form button[type=submit]")
        await asyncio.to_thread(submit.click)
        await until(lambda: confirm(driver), "the confirmation dialog")
        await until(lambda: "Done: room_message" in text_of(driver, "action-result"), "the edit")
        wanted = {"text": words, "level": "warning"}
        assert await message_read_within(client, room_deal, joiners[0], wanted) == wanted
        assert (await read_ticket(client, room_deal, joiners[-1]))["message"] == wanted
        await until(
            lambda: text_of(driver, "room-message") == "warning: " + words, "the message shown"
        )
        await until(
            lambda: any(
                "room_message" in r and "console:" in r and words in r for r in _ledger_rows(driver)
            ),
            "the edit in the page's ledger",
            on_timeout=lambda: _ledger_rows(driver)[:5],
        )
        await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "room-panel.png"))

        # The queue's panel: one dead letter waiting; the button retries it.
        pick = await until(lambda: _pick(driver, queue_deal), "the queue's deal in the list")
        await asyncio.to_thread(pick.click)
        await until(lambda: text_of(driver, "queue-dead-waiting") == "1", "the dead letter")
        assert _shown(driver, "queue-panel") and not _shown(driver, "room-panel")
        assert text_of(driver, "queue-mode") == "queue"
        assert text_of(driver, "queue-dead") == "1" and text_of(driver, "queue-depth") == "0"
        await asyncio.to_thread(driver.find_element(By.ID, "retry-button").click)
        await until(lambda: confirm(driver), "the confirmation dialog")
        await until(
            lambda: "1 re-submitted" in text_of(driver, "action-result"), "the retry's answer"
        )
        ((_, order_id, retried_order_id, outcome),) = await dead_letters(db, queue_deal)
        assert retried_order_id and retried_order_id != order_id
        assert outcome in ("QUEUED", "PENDING_PAYMENT")
        await until(lambda: text_of(driver, "queue-dead-waiting") == "0", "none left to retry")
        assert not driver.find_element(By.ID, "retry-button").is_enabled()
        await until(
            lambda: any("dead_letter_retry" in r and "console:" in r for r in _ledger_rows(driver)),
            "the retry in the page's ledger",
            on_timeout=lambda: _ledger_rows(driver)[:5],
        )
        await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "queue-panel.png"))

        async def committed() -> bool:
            row = await db.fetchone(
                "SELECT status FROM orders WHERE id = %s", (str(retried_order_id),)
            )
            return row is not None and row[0] == "PENDING_PAYMENT"

        await until_true(committed, "the retried request committed")
        report = await assert_invariants(db, rds, queue_deal)
        assert report["totals"] == {"total": 5, "available": 4, "held": 1, "sold": 0}
    finally:
        await client.close()
