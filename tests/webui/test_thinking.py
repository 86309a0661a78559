"""The chat page with a reasoning model (the tiny random Qwen3 of tests/reasoning, its thinking
ended by the server's --max-thinking-tokens): the thinking streams into a closed <details>
above the answer, as text, and is not sent back with the next request."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from page_helpers import (
    answer_done,
    last_answer,
    open_chat,
    saved_conversations,
    screenshot,
    set_field,
    wait,
)
from selenium.webdriver.common.by import By
from server_harness import Server, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reasoning"))

from thinking_model import make_thinking_model  # noqa: E402

QUESTION = "t7 t9"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = make_thinking_model(tmp_path_factory.mktemp("thinking") / "thinker")
    s = start_server("--model", f"thinker={model}", "--max-thinking-tokens", "4",
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    yield s
    assert s.stop() == 0, s.log()


def expected(server: Server) -> tuple[str, str, int]:
    """The thinking, answer and thinking-token count the server gives the page's request."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "thinker", "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0, "top_p": 1, "max_tokens": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    return (message["reasoning_content"], message["content"],
            body["usage"]["completion_tokens_details"]["reasoning_tokens"])


def test_thinking_is_folded_apart_and_not_sent_back(browser, thinker: Server) -> None:
    thinking, answer_text, thought = expected(thinker)
    assert thinking.strip() and answer_text.strip() and thinking.strip() not in answer_text
    open_chat(browser, thinker)
    browser.execute_script("localStorage.clear();")
    open_chat(browser, thinker)
    browser.execute_script(
        "window.sentBodies = []; const f = window.fetch; window.fetch = (u, o) => {"
        " if (o && o.body) window.sentBodies.push(JSON.parse(o.body)); return f(u, o); };")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "10")
    set_field(browser, "input", QUESTION)
    browser.find_element(By.ID, "send").click()
    wait(browser).until(answer_done)
    answer = last_answer(browser)
    details = answer.find_element(By.CSS_SELECTOR, "details.thinking")
    assert details.get_property("open") is False  # folded by default
    shown = details.find_element(By.CLASS_NAME, "thinking-text").get_attribute("textContent")
    assert shown.strip() == thinking.strip()
    assert details.find_element(By.TAG_NAME, "summary").get_attribute(
        "textContent") == f"Thought for {thought} tokens"
    content = answer.find_element(By.CLASS_NAME, "content").text
    assert content.strip() == answer_text.strip()
    assert thinking.strip() not in content
    details.find_element(By.TAG_NAME, "summary").click()
    screenshot(browser, "webui-thinking.png")
    details.find_element(By.TAG_NAME, "summary").click()  # folded again
    # Saved for showing, apart from the answer.
    saved = saved_conversations(browser)[0]["messages"][-1]
    assert saved["content"].strip() == answer_text.strip()
    assert saved["thinking"].strip() == thinking.strip()
    # The next request carries the answer only.
    set_field(browser, "input", "t3")
    browser.find_element(By.ID, "send").click()
    wait(browser).until(lambda b: answer_done(b) and len(b.find_elements(
        By.CSS_SELECTOR, ".msg.assistant")) == 2)
    sent = browser.execute_script("return window.sentBodies;")[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in sent)
    assert sent[1]["content"].strip() == answer_text.strip()
    assert all(thinking.strip() not in m["content"] for m in sent)
    # After a reload the first answer still shows its thinking, folded.
    browser.refresh()
    wait(browser).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "details.thinking")) == 2)
    first = browser.find_elements(By.CSS_SELECTOR, "details.thinking")[0]
    assert first.get_property("open") is False
    assert thinking.strip() in first.get_attribute("textContent")
    browser.execute_script("localStorage.clear();")
