"""The dashboard in a real headless browser: Debian's chromium and chromium-driver,
driven by Selenium (nothing is downloaded: the driver's path is given, Selenium
Manager stays off). .ci/run installs both; elsewhere the test skips when they are
missing, and fails under CI=true.

Set FELIX_DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the docs' screenshot."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

import felix_redis
from tests.support.dashboard import serving

T, N, S, G = "acme", "prod", "checkout", "payments"
A = (T, N, S)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
T_ = TypeVar("T_")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("no chromium/chromedriver here (apt-get install chromium chromium-driver)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def steady(do: Callable[[], T_]) -> T_:
    """``do()`` again when the live refresh swapped the element it found (the page
    replaces its content in place every interval)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return do()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return do()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not steady(check):
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.1)


def checkout(redis_url: str, shards: int) -> felix_redis.Client:
    """A client on the (flushed) test Redis with the stream and group the tests show."""
    c = felix_redis.connect(redis_url)
    c.stream_create(*A, shards=shards)
    c.group_create(*A, G)
    return c


def test_follow_a_group_see_a_dead_letter_appear_and_redrive_it(
    browser: WebDriver, raw: redis.Redis, redis_url: str
) -> None:
    c = checkout(redis_url, 4)
    c.stream_create(T, N, "emails")
    c.group_create(T, N, "emails", "senders")
    for i in range(40):
        c.publish(*A, f'{{"order": {i}, "task": "capture"}}'.encode(), key=f"order-{i}")
    batch = c.group_poll(*A, 0, G, max_records=6)
    c.group_ack(*A, 0, G, batch[0].claim)
    with serving(redis_url, interval=1) as base:
        browser.get(base + "/")
        assert "Overview" in browser.find_element(By.TAG_NAME, "h1").text

        def text(element_id: str) -> str:
            return steady(lambda: str(browser.find_element(By.ID, element_id).text))

        row = f'tr[data-group="{T}/{N}/{S}/{G}"]'
        # the columns after the age: unfinished, dead, in flight, owed, scheduled, lag
        assert " 39 0 5 0 0 39" in steady(lambda: browser.find_element(By.CSS_SELECTOR, row).text)
        # follow the group
        steady(lambda: browser.find_element(By.CSS_SELECTOR, row).find_element(By.LINK_TEXT, G).click())
        wait_for("the group page", lambda: bool(browser.find_elements(By.ID, "dead")))
        assert (text("dead"), text("in-flight"), text("lag")) == ("0", "5", "39")
        assert len(steady(lambda: browser.find_elements(By.CSS_SELECTOR, "#shards tbody tr"))) == 4

        # dead-letter a record from Python: the open page shows it without a reload
        marker = browser.find_element(By.TAG_NAME, "header")  # outside the part refreshed in place
        c.group_dead_letter(*A, 0, G, batch[1].claim, reason="card declined")
        wait_for("the new dead count", lambda: text("dead") == "1")
        assert marker.is_displayed()  # the same document: updated in place, not reloaded

        steady(lambda: browser.find_element(By.LINK_TEXT, "Dead letters (1)").click())
        record = batch[1].claim.rsplit(":", 1)[0]
        letter = f'tr[data-record="{record}"]'
        wait_for("the dead letter", lambda: bool(browser.find_elements(By.CSS_SELECTOR, letter)))
        shown = steady(lambda: browser.find_element(By.CSS_SELECTOR, letter).text)
        assert "card declined" in shown and '"task": "capture"' in shown
        shot = os.environ.get("FELIX_DASHBOARD_SCREENSHOT")

        # redrive it, behind a confirmation (a checked box holds the live refresh)
        steady(lambda: browser.find_element(By.CSS_SELECTOR, f"{letter} input.pick").click())
        browser.find_element(By.CSS_SELECTOR, 'button[data-verb="redrive"][data-scope="selected"]').click()
        confirm = browser.find_element(By.ID, "confirm")
        assert confirm.is_displayed() and "Redrive 1 dead letter" in confirm.text
        time.sleep(1.5)  # a refresh interval passes: the confirmation stays, nothing happened
        assert browser.find_element(By.ID, "confirm").is_displayed()
        assert c.group_describe(*A, G).dead == 1
        browser.find_element(By.ID, "confirm-yes").click()
        wait_for("the dead count drop", lambda: "0 dead letters" in text("dead-total"))
        assert "redriven: 1" in text("action-result")
        time.sleep(1.5)  # a live refresh swaps the part the result is in: it stays said
        assert "redriven: 1" in text("action-result")
        assert c.group_describe(*A, G).dead == 0

        # back on the group page, the count has dropped too
        steady(lambda: browser.find_element(By.LINK_TEXT, G).click())
        wait_for("the group page", lambda: bool(browser.find_elements(By.ID, "owed")))
        assert (text("dead"), text("owed")) == ("0", "1")  # redriven: owed again

        if shot:
            # the docs' picture: a group with some history and a dead letter
            c.group_dead_letter(*A, 0, G, batch[2].claim, reason="card declined")
            time.sleep(4)
            browser.refresh()
            wait_for("the group page", lambda: text("dead") == "1")
            browser.set_window_size(1280, 1400)
            Path(shot).write_bytes(browser.get_screenshot_as_png())
    c.close()


def test_usable_on_a_phone_and_readable_without_javascript(
    browser: WebDriver, raw: redis.Redis, redis_url: str
) -> None:
    c = checkout(redis_url, 2)
    c.publish(*A, b"x" * 300)
    with serving(redis_url) as base:
        browser.set_window_size(390, 844)  # a phone
        for path in ("/", f"/streams/{T}/{N}/{S}/groups/{G}", f"/streams/{T}/{N}/{S}/records?shard=0"):
            browser.get(base + path)
            width = browser.execute_script("return document.documentElement.scrollWidth")
            inner = browser.execute_script("return window.innerWidth")
            assert width <= inner, f"{path} scrolls sideways on a phone ({width} > {inner})"
        # JavaScript off: the numbers are in the HTML the server sent
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
        browser.get(base + f"/streams/{T}/{N}/{S}/groups/{G}")
        assert browser.find_element(By.ID, "lag").text == "1"
        assert browser.find_element(By.ID, "live-status").text == ""  # the script did not run
    c.close()
