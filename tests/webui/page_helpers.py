"""What the page tests share: waiting in the browser, its console errors, the chat page's
fields and answers, and the screenshots for the docs (with TOKENMILL_SCREENSHOT_DIR set)."""

from __future__ import annotations

import os

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from server_harness import Server


def wait(browser, seconds: float = 60) -> WebDriverWait:
    return WebDriverWait(browser, seconds, poll_frequency=0.2)


def severe_logs(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def leave_page(browser) -> None:
    """Go to a blank page and drop the console of the one before (a dashboard polling a server
    that a finished test stopped logs errors until it is left)."""
    browser.get("about:blank")
    browser.get_log("browser")


def open_chat(browser, server: Server) -> None:
    leave_page(browser)
    browser.get(server.url + "/")
    wait(browser).until(lambda b: Select(b.find_element(By.ID, "model")).options)


def open_dashboard(browser, server: Server) -> None:
    leave_page(browser)
    browser.get(server.url + "/dashboard")
    wait(browser).until(lambda b: b.find_element(By.ID, "d-finished").text != "-")


def set_field(browser, element_id: str, value: str) -> None:
    el = browser.find_element(By.ID, element_id)
    el.clear()
    if value:
        el.send_keys(value)


def screenshot(browser, name: str) -> None:
    folder = os.environ.get("TOKENMILL_SCREENSHOT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        browser.save_screenshot(os.path.join(folder, name))


def running(server: Server) -> int:
    return httpx.get(f"{server.url}/stats", timeout=10).json()["models"][server.model]["running"]


def last_answer(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def answer_done(browser) -> bool:
    """The last answer has its final stats line."""
    answers = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    if not answers:
        return False
    stats = answers[-1].find_element(By.CLASS_NAME, "stats").text
    return "tokens" in stats and "streaming" not in stats


def saved_conversations(browser) -> list[dict]:
    return browser.execute_script(
        "return JSON.parse(localStorage.getItem('tokenmill.conversations') || '[]');")
