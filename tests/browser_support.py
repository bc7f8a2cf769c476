"""Headless Chromium for the browser tests: Debian's chromium and chromium-driver
driven by Selenium, offline (Selenium Manager never fetches a browser or a driver),
and the polling the tests wait with.

    chromium(language, window)  ->  a webdriver.Chrome (skips the test when either
                                    Selenium or Chromium is missing)
    browser(...)                ->  the same as a context manager that quits it
    until(check, what)          ->  the check's first truthy value, polled off the
                                    event loop for at most WAIT_SECONDS
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_SECONDS = 20.0


def chromium(language: str = "en-US", window: str = "1280,1400") -> Any:
    """Headless Chromium whose preferred languages are `language` first, with the
    page's console messages kept (`driver.get_log("browser")`)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(
            "Chromium is not installed: apt-get install chromium chromium-driver"
            " (scripts/test installs them on Debian)"
        )
    os.environ["SE_OFFLINE"] = "true"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={window}",
        "--no-first-run",
        "--disable-extensions",
        f"--lang={language}",
    ):
        options.add_argument(arg)
    primary = language.split("-")[0]
    options.add_experimental_option("prefs", {"intl.accept_languages": f"{language},{primary}"})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@contextmanager
def browser(language: str = "en-US", window: str = "1280,1400") -> Iterator[Any]:
    d = chromium(language, window)
    try:
        yield d
    finally:
        d.quit()


async def until(
    check: Callable[[], Any], what: str, on_timeout: Callable[[], Any] | None = None
) -> Any:
    """Poll a blocking browser check off the event loop until it returns a truthy value."""
    deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            last = await asyncio.to_thread(check)
        except Exception as exc:  # the element may be re-rendered under our feet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(0.2)
    seen = await asyncio.to_thread(on_timeout) if on_timeout else None
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}; seen: {seen!r}")


def text_of(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.ID, element_id).text)


def confirm(driver: Any) -> bool:
    """Press OK in the console's confirmation dialog, when it is open."""
    from selenium.webdriver.common.by import By

    dialog = driver.find_element(By.ID, "confirm")
    if not dialog.get_attribute("open"):
        return False
    driver.find_element(By.ID, "confirm-ok").click()
    return True
