"""The web page in a real headless browser: the chat playground streams an answer, stop
aborts it on the server, model output is shown as text only, conversations survive a reload,
the dashboard's numbers follow the traffic, an API key is asked for and sent, and
`--no-webui` removes the pages. With TOKENMILL_SCREENSHOT_DIR set it saves each page's
screenshot there (the README's images)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select, WebDriverWait
from server_harness import Server, start_server

KEY = "page-test-key"


def wait(browser, seconds: float = 60) -> WebDriverWait:
    return WebDriverWait(browser, seconds, poll_frequency=0.2)


def severe_logs(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def open_chat(browser, server: Server) -> None:
    browser.get(server.url + "/")
    wait(browser).until(lambda b: Select(b.find_element(By.ID, "model")).options)


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


def test_chat_streams_an_answer_and_lists_only_chat_models(browser, server: Server) -> None:
    open_chat(browser, server)
    assert severe_logs(browser) == []
    options = [o.text for o in Select(browser.find_element(By.ID, "model")).options]
    assert options == [server.model]  # the embedding model is not offered for chat
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "24")
    set_field(browser, "input", "Name three rivers.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: "tokens" in last_answer(b).find_element(
        By.CLASS_NAME, "stats").text and "streaming" not in last_answer(b).text)
    answer = last_answer(browser)
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "TTFT" in stats and "tokens/s" in stats and "24 tokens" in stats, stats
    assert answer.find_element(By.CLASS_NAME, "content").text.strip()
    assert severe_logs(browser) == []
    screenshot(browser, "webui-chat.png")
    # The conversation is kept in local storage: it is there after a reload.
    browser.refresh()
    wait(browser).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    assert "Name three rivers." in browser.find_element(By.ID, "messages").text


def test_stop_aborts_the_request_on_the_server(browser, server: Server) -> None:
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    set_field(browser, "temperature", "0.8")
    set_field(browser, "max-tokens", "450")  # the test servers' context is 512
    set_field(browser, "input", "Write a very long story about a lighthouse keeper.")
    browser.find_element(By.ID, "send").click()
    # Wait until the server runs it and text arrives, then stop.
    wait(browser).until(lambda b: running(server) >= 1
                        and last_answer(b).find_element(By.CLASS_NAME, "content").text)
    before = server.metrics().get("tokenmill:request_success_total[abort]", 0.0)
    browser.find_element(By.ID, "stop").click()
    wait(browser, 30).until(lambda b: running(server) == 0)
    wait(browser, 30).until(lambda b: server.metrics().get(
        "tokenmill:request_success_total[abort]", 0.0) == before + 1)
    assert "stopped" in last_answer(browser).find_element(By.CLASS_NAME, "stats").text
    assert browser.find_element(By.ID, "send").is_enabled()


def test_model_output_is_text_not_html(browser, server: Server) -> None:
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    # A JSON-schema answer that can only be this string: real model output, streamed.
    evil = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='x'\">"
    browser.find_element(By.ID, "json-mode").click()
    set_field(browser, "json-schema", json.dumps({"type": "string", "enum": [evil]}))
    set_field(browser, "max-tokens", "80")
    set_field(browser, "input", "Say something.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: "tokens" in last_answer(b).find_element(
        By.CLASS_NAME, "stats").text and "streaming" not in last_answer(b).text)
    content = last_answer(browser).find_element(By.CLASS_NAME, "content")
    assert "<script>document.title='pwned'</script>" in content.text
    assert content.find_elements(By.TAG_NAME, "script") == []
    assert content.find_elements(By.TAG_NAME, "img") == []
    assert "pwned" not in browser.title and browser.title != "x"
    browser.find_element(By.ID, "json-mode").click()  # back off for the other tests
    # Markdown still renders: code blocks and bold as elements, their text as text.
    browser.execute_script(
        "localStorage.setItem('tokenmill.conversations', JSON.stringify([{id: 1, title: 'md',"
        " messages: [{role: 'assistant', content: '**bold** and `x<b>y</b>`\\n\\n"
        "```html\\n<script>alert(1)</script>\\n```', stats: ''}]}]));")
    browser.refresh()
    content = wait(browser).until(lambda b: b.find_element(By.CSS_SELECTOR,
                                                           ".msg.assistant .content"))
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert content.find_element(By.CSS_SELECTOR, "p code").text == "x<b>y</b>"
    assert content.find_element(By.CSS_SELECTOR, "pre code").text == "<script>alert(1)</script>"
    assert content.find_elements(By.TAG_NAME, "script") == []
    assert severe_logs(browser) == []


def test_dashboard_follows_the_traffic(browser, server: Server) -> None:
    browser.get(server.url + "/dashboard")
    wait(browser).until(lambda b: b.find_element(By.ID, "d-finished").text != "-")
    assert severe_logs(browser) == []
    before = int(browser.find_element(By.ID, "d-finished").text)
    for _ in range(6):  # a few seconds of traffic, for the charts
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": server.model, "prompt": "Once upon a time", "max_tokens": 16,
            "ignore_eos": True})
        assert r.status_code == 200
    wait(browser).until(lambda b: int(b.find_element(By.ID, "d-finished").text) >= before + 3)
    assert float(browser.find_element(By.ID, "d-output-tps").text) > 0
    assert browser.find_element(By.ID, "d-ttft").text != "-"
    assert browser.find_element(By.ID, "d-energy").text.endswith("J (est.)")
    assert "script" in browser.find_element(By.ID, "d-drift").text  # the drift signals
    screenshot(browser, "webui-dashboard.png")
    assert severe_logs(browser) == []


@pytest.fixture(scope="module")
def keyed() -> Server:
    s = start_server("--api-key", KEY, headers={"Authorization": f"Bearer {KEY}"})
    yield s
    assert s.stop() == 0, s.log()


def test_the_page_asks_for_the_key_and_sends_it(browser, keyed: Server) -> None:
    assert httpx.get(f"{keyed.url}/stats", timeout=10).status_code == 401
    assert httpx.get(f"{keyed.url}/api/tags", timeout=10).status_code == 401
    browser.get(keyed.url + "/")
    browser.execute_script("localStorage.clear();")
    browser.refresh()
    dialog = wait(browser).until(ec.visibility_of_element_located((By.ID, "key-dialog")))
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait(browser).until(lambda b: Select(b.find_element(By.ID, "model")).options)
    assert not dialog.is_displayed()
    assert [o.text for o in Select(browser.find_element(By.ID, "model")).options] == [
        keyed.model]
    browser.execute_script("localStorage.clear();")


def test_no_webui_leaves_the_pages_out() -> None:
    s = start_server("--no-webui")
    try:
        assert httpx.get(f"{s.url}/", timeout=10).status_code == 404
        assert httpx.get(f"{s.url}/dashboard", timeout=10).status_code == 404
        assert httpx.get(f"{s.url}/ui/app.js", timeout=10).status_code == 404
        assert httpx.get(f"{s.url}/stats", timeout=10).status_code == 200
    finally:
        assert s.stop() == 0
