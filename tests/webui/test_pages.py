"""The chat page in a real headless browser: it streams an answer, stop aborts it on the server
and counts what came, a refused request leaves no empty turn behind, model output is shown as
text only (markdown built as elements), conversations survive a reload, an empty one shows a
hint, an API key is asked for and sent (its button only where the server wants one), and
`--no-webui` removes the pages. With TOKENMILL_SCREENSHOT_DIR set it saves the page's
screenshot there (the docs' images)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from page_helpers import (
    answer_done,
    last_answer,
    open_chat,
    open_dashboard,
    running,
    saved_conversations,
    screenshot,
    set_field,
    severe_logs,
    wait,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select
from server_harness import Server, start_server

KEY = "page-test-key"


def test_chat_streams_an_answer_and_lists_only_chat_models(browser, server: Server) -> None:
    open_chat(browser, server)
    assert severe_logs(browser) == []
    options = [o.text for o in Select(browser.find_element(By.ID, "model")).options]
    assert options == [server.model]  # the embedding model is not offered for chat
    assert not browser.find_element(By.ID, "key-button").is_displayed()  # no --api-key
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "60")
    set_field(browser, "input", "Name three rivers.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(answer_done)
    answer = last_answer(browser)
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "TTFT" in stats and "tokens/s" in stats, stats
    counted = re.search(r"· (\d+) tokens", stats)  # the server's usage, not "~" deltas
    assert counted and 0 < int(counted.group(1)) <= 60, stats
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
    wait(browser, 30).until(lambda b: b.find_element(By.ID, "send").is_enabled())
    stats = last_answer(browser).find_element(By.CLASS_NAME, "stats").text
    assert "stopped" in stats
    # No usage chunk comes after a stop: the deltas shown are counted instead of "0 tokens".
    shown = len(saved_conversations(browser)[0]["messages"][-1]["content"])
    tokens = int(re.search(r"~(\d+) tokens", stats).group(1))
    assert 0 < tokens <= shown, stats
    # The next request is answered as before.
    set_field(browser, "max-tokens", "8")
    set_field(browser, "input", "And a short one?")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: answer_done(b) and len(b.find_elements(
        By.CSS_SELECTOR, ".msg.assistant")) == 2)
    stats = last_answer(browser).find_element(By.CLASS_NAME, "stats").text
    assert re.search(r"(^| )[1-8] tokens", stats), stats  # the server's own count


def test_a_refused_request_leaves_no_empty_turn(browser, server: Server) -> None:
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "100000")  # beyond the context: refused with a 400
    set_field(browser, "input", "Name a colour.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: b.find_element(By.ID, "error").text
                        and b.find_element(By.ID, "send").is_enabled())
    assert "maximum context length" in browser.find_element(By.ID, "error").text
    assert [m for m in severe_logs(browser) if "400 (Bad Request)" not in m] == []
    # Nothing empty is saved; the question is back in the input box to send again.
    assert [m["content"] for m in saved_conversations(browser)[0]["messages"]] == []
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Name a colour."
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    set_field(browser, "max-tokens", "8")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(answer_done)
    messages = saved_conversations(browser)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Name a colour." and messages[1]["content"]
    assert browser.find_element(By.ID, "error").text == ""


def test_an_empty_turn_saved_earlier_is_not_sent_back(browser, server: Server) -> None:
    open_chat(browser, server)
    browser.execute_script(
        "localStorage.setItem('tokenmill.conversations', JSON.stringify([{id: 1, title: 'old',"
        " messages: [{role: 'user', content: 'Hi'}, {role: 'assistant', content: '',"
        " stats: '0 tokens'}]}]));")
    open_chat(browser, server)
    # Record the bodies the page sends.
    browser.execute_script(
        "window.sentBodies = []; const f = window.fetch; window.fetch = (u, o) => {"
        " if (o && o.body) window.sentBodies.push(JSON.parse(o.body)); return f(u, o); };")
    set_field(browser, "max-tokens", "8")
    set_field(browser, "input", "Hello again.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: answer_done(b) and len(b.find_elements(
        By.CSS_SELECTOR, ".msg.assistant")) == 2)
    sent = browser.execute_script("return window.sentBodies;")
    assert [(m["role"], m["content"]) for m in sent[-1]["messages"]] == [
        ("user", "Hi"), ("user", "Hello again.")]
    browser.execute_script("localStorage.clear();")


def test_an_empty_conversation_shows_a_hint(browser, server: Server) -> None:
    open_chat(browser, server)
    browser.find_element(By.ID, "new-chat").click()
    hint = browser.find_element(By.ID, "empty-hint")
    assert hint.is_displayed() and server.model in hint.text and "Enter" in hint.text
    set_field(browser, "max-tokens", "4")
    set_field(browser, "input", "Hi.")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(answer_done)
    assert browser.find_elements(By.ID, "empty-hint") == []
    # A fresh page with no conversation at all shows it too.
    browser.execute_script("localStorage.clear();")
    open_chat(browser, server)
    wait(browser).until(lambda b: server.model in b.find_element(By.ID, "empty-hint").text)


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
    wait(browser).until(answer_done)
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


def render(browser, text: str) -> str:
    """The page's markdown renderer on ``text``, as the HTML of the elements it built."""
    return browser.execute_script(
        "const d = document.createElement('div'); renderMarkdown(arguments[0], d);"
        " return d.innerHTML;", text)


MARKDOWN = """# Title

Some *italic*, **bold *nested*** and `a<b>` text,
on two lines.

- one
- two with `code`

3. third
4. fourth

> quoted

```python
if a < b:
    print("<b>")
```"""


def test_answers_are_rendered_as_markdown_built_from_elements(browser, server: Server) -> None:
    open_chat(browser, server)
    assert render(browser, MARKDOWN) == (
        "<h1>Title</h1>"
        "<p>Some <em>italic</em>, <strong>bold <em>nested</em></strong> and "
        "<code>a&lt;b&gt;</code> text,\non two lines.</p>"
        "<ul><li>one</li><li>two with <code>code</code></li></ul>"
        '<ol start="3"><li>third</li><li>fourth</li></ol>'
        "<blockquote><p>quoted</p></blockquote>"
        '<pre><code data-lang="python">if a &lt; b:\n    print("&lt;b&gt;")</code></pre>')
    # While an answer streams, an unclosed fence is already a code block.
    assert render(browser, "Code:\n```\nx = 1") == "<p>Code:</p><pre><code>x = 1</code></pre>"
    # HTML in any markdown construct stays text, in the page as in the renderer.
    evil = ("# <img src=x onerror=\"document.title='h1'\">\n\n"
            "- <script>document.title='li'</script>\n\n"
            "> <iframe src=\"javascript:document.title='q'\"></iframe>\n\n"
            "**<svg onload=\"document.title='b'\"></svg>** *<b>i</b>* `<i>c</i>`\n\n"
            "```\n<img src=y onerror=\"document.title='pre'\">\n```")
    browser.execute_script(
        "localStorage.setItem('tokenmill.conversations', JSON.stringify([{id: 1, title: 'md',"
        " messages: [{role: 'assistant', content: arguments[0], stats: ''}]}]));", evil)
    browser.refresh()
    content = wait(browser).until(lambda b: b.find_element(By.CSS_SELECTOR,
                                                           ".msg.assistant .content"))
    tags = [e.tag_name for e in content.find_elements(By.CSS_SELECTOR, "*")]
    assert tags == ["h1", "ul", "li", "blockquote", "p", "p", "strong", "em", "code", "pre",
                    "code"], tags
    for shown in ("<img src=x onerror=", "<script>document.title='li'</script>", "<iframe",
                  "<svg onload=", "<b>i</b>", "<i>c</i>", "<img src=y"):
        assert shown in content.text
    assert browser.title == "tokenmill: chat"
    browser.execute_script("localStorage.clear();")
    assert severe_logs(browser) == []


@pytest.fixture(scope="module")
def keyed() -> Server:
    s = start_server("--api-key", KEY, "--cost-per-hour", "3.6",
                     headers={"Authorization": f"Bearer {KEY}"})
    yield s
    assert s.stop() == 0, s.log()


def test_the_page_asks_for_the_key_and_sends_it(browser, keyed: Server) -> None:
    assert httpx.get(f"{keyed.url}/stats", timeout=10).status_code == 401
    assert httpx.get(f"{keyed.url}/stats/history", timeout=10).status_code == 401
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
    assert browser.find_element(By.ID, "key-button").is_displayed()  # to change the key
    # The dashboard too; with --cost-per-hour it shows a price in a few digits.
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{keyed.url}/v1/completions", headers=auth, timeout=120, json={
        "model": keyed.model, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
    entry = httpx.get(f"{keyed.url}/stats", headers=auth, timeout=10).json()
    assert entry["api_key_required"] is True
    assert entry["models"][keyed.model]["usd_per_1k_output_tokens"] > 0
    open_dashboard(browser, keyed)
    assert browser.find_element(By.ID, "key-button").is_displayed()
    assert re.fullmatch(r"\$\d+(\.\d{1,2}|\.0*\d{1,2})?", browser.find_element(
        By.ID, "d-cost").text)
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
