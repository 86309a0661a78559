"""Reasoning through the engine: the tiny Qwen3 is pushed (logit_bias) to write "t5" over
and over inside the thinking its chat template opens; the parser splits thinking from answer,
the budget makes the engine end the thinking, the usage counts the thinking tokens."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from thinking_model import Server

T5 = {"5": 100.0}  # the model writes "t5" and nothing else (unless the budget forces)


def chat(server: Server, **body: Any) -> httpx.Response:
    body = {"model": "thinker", "messages": [{"role": "user", "content": "t7 t9"}],
            "temperature": 0, "logit_bias": T5, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def stream(server: Server, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chunks' deltas of choice 0, and the usage chunk's usage."""
    body = {"model": "thinker", "messages": [{"role": "user", "content": "t7 t9"}],
            "temperature": 0, "logit_bias": T5, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    deltas, usage = [], {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            deltas += [c["delta"] for c in chunk["choices"]]
    return deltas, usage


def test_budget_ends_the_thinking_and_the_answer_follows(server: Server) -> None:
    r = chat(server, max_tokens=8, thinking_token_budget=3)
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "t5 t5 t5"
    assert message["reasoning"] == "t5 t5 t5"
    # 8 tokens: 3 of thinking, the forced </think>, 4 of answer.
    assert message["content"] == "t5 t5 t5 t5"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_the_servers_default_budget_applies_and_a_request_overrides_it(server: Server) -> None:
    message = chat(server, max_tokens=7).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "t5 t5 t5 t5"  # --max-thinking-tokens 4
    assert message["content"] == "t5 t5"
    unbounded = chat(server, max_tokens=6, max_thinking_tokens=6).json()
    message = unbounded["choices"][0]["message"]
    assert message["reasoning_content"] == "t5 t5 t5 t5 t5 t5" and message["content"] is None
    assert unbounded["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}


def test_a_sampled_request_is_ended_by_the_budget_too(server: Server) -> None:
    r = chat(server, max_tokens=6, thinking_token_budget=1, temperature=0.8, seed=3)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "t5"
    assert message["content"] == "t5 t5 t5 t5"


def test_streamed_thinking_and_answer_add_up_to_the_whole_ones(server: Server) -> None:
    deltas, usage = stream(server, max_tokens=8, thinking_token_budget=3)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    whole = chat(server, max_tokens=8, thinking_token_budget=3).json()["choices"][0]["message"]
    assert reasoning == whole["reasoning_content"] and content == whole["content"]
    # Thinking arrives token by token, before any of the answer.
    thinking_at = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    answer_at = [i for i, d in enumerate(deltas) if d.get("content")]
    assert len(thinking_at) == 3 and max(thinking_at) < min(answer_at)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_enable_thinking_false_answers_without_thinking(server: Server) -> None:
    r = chat(server, max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    body = r.json()
    message = body["choices"][0]["message"]
    # No thinking: the text is the content as the detokenizer wrote it (a word-level
    # tokenizer puts a space before every word).
    assert message["content"] == " t5 t5 t5 t5" and "reasoning_content" not in message
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize(("model", "extra", "param"), [
    ("thinker", {"thinking_token_budget": -1}, "thinking_token_budget"),
    ("thinker", {"thinking_token_budget": 9, "max_tokens": 8}, "thinking_token_budget"),
    ("thinker", {"max_thinking_tokens": 2, "thinking_token_budget": 2}, "max_thinking_tokens"),
    ("thinker", {"thinking_token_budget": 2,
                 "response_format": {"type": "json_object"}}, "thinking_token_budget"),
    ("smol", {"thinking_token_budget": 2}, "thinking_token_budget"),
    ("smol", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
])
def test_bad_thinking_controls_are_refused_by_name(server: Server, model: str,
                                                   extra: dict[str, Any], param: str) -> None:
    before = server.metrics()["tokenmill:request_success_total[length]"]
    r = chat(server, model=model, **{"max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # Nothing reached the engine, and the next request is answered as before.
    assert server.metrics()["tokenmill:request_success_total[length]"] == before
    assert chat(server, max_tokens=6, thinking_token_budget=2).json()["choices"][0][
        "message"]["content"] == "t5 t5 t5"


def test_a_model_without_thinking_answers_as_before(server: Server) -> None:
    body = chat(server, model="smol", max_tokens=3, logit_bias=None).json()
    message = body["choices"][0]["message"]
    assert set(message) == {"role", "content", "tool_calls"}
    assert body["usage"].get("completion_tokens_details") is None


def test_each_choice_and_each_batched_request_has_its_own_budget(server: Server) -> None:
    body = chat(server, max_tokens=5, thinking_token_budget=2, n=2, temperature=0.7,
                seed=1).json()
    for choice in body["choices"]:
        assert choice["message"]["reasoning_content"] == "t5 t5"
        assert choice["message"]["content"] == "t5 t5"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    # Requests with different budgets in one batch, beside one without thinking.
    with ThreadPoolExecutor(5) as pool:
        budgets = [pool.submit(chat, server, max_tokens=6, thinking_token_budget=b)
                   for b in range(5)]
        plain = pool.submit(chat, server, max_tokens=6,
                            chat_template_kwargs={"enable_thinking": False})
        for b, future in enumerate(budgets):
            message = future.result().json()["choices"][0]["message"]
            assert message["reasoning_content"] == " ".join(["t5"] * b)
            assert message["content"] == " ".join(["t5"] * (5 - b))
        assert plain.result().json()["choices"][0]["message"]["content"] == " t5" * 6


def test_tokenmill_chat_shows_the_thinking_apart_from_the_answer(server: Server) -> None:
    from tokenmill.chat_remote import ServerClient, stream_remote

    out = io.StringIO()
    answer = stream_remote(ServerClient(server.url, None, "thinker"), "chat/completions", {
        "messages": [{"role": "user", "content": "t7 t9"}], "max_tokens": 8,
        "temperature": 0, "logit_bias": T5, "thinking_token_budget": 3}, out)
    assert out.getvalue() == "(thinking) t5 t5 t5\n\nt5 t5 t5 t5"
    assert "".join(answer.text) == "t5 t5 t5 t5"  # the conversation keeps the answer only


def test_an_output_constraint_makes_the_output_the_answer(server: Server) -> None:
    # The template opened the thinking, but the constraint holds from the first token: what
    # the model writes is the answer (a forced tool call is read the same way).
    body = chat(server, max_tokens=4, structured_outputs={"choice": ["t5"]}).json()
    message = body["choices"][0]["message"]
    assert message["content"] == " t5" and "reasoning_content" not in message
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_reasoning_effort_reaches_a_template_that_reads_it(tmp_path) -> None:
    from thinking_model import write_thinking_tokenizer

    from tokenmill.api.chat import render_prompt
    from tokenmill.api.protocol import ChatCompletionRequest
    from tokenmill.tokenizer import Tokenizer

    write_thinking_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if reasoning_effort is defined %}Reasoning: "
                               "{{ reasoning_effort }} {% endif %}{{ messages[0].content }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "t7"}],
                                reasoning_effort="high")
    assert render_prompt(tokenizer, req, 512)[0] == "Reasoning: high t7"


def test_reasoning_effort_for_a_model_that_does_not_think_is_refused(server: Server) -> None:
    r = chat(server, model="smol", max_tokens=2, logit_bias=None, reasoning_effort="low")
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    bad = chat(server, max_tokens=2, reasoning_effort="extreme")
    assert bad.status_code == 400
    ok = chat(server, max_tokens=2, reasoning_effort="low")  # a thinking model takes it
    assert ok.status_code == 200
