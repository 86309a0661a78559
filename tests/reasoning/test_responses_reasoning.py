"""The Responses API with a reasoning model: a ``reasoning`` output item (and its streamed
events) before the message, with the same split as /v1/chat/completions."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from thinking_model import Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(server: Server) -> dict[str, Any]:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "thinker", "messages": [{"role": "user", "content": "t7 t9"}],
        "temperature": 0, "max_tokens": 8}).json()


def test_reasoning_item_comes_before_the_message(client: openai.OpenAI,
                                                 server: Server) -> None:
    expected = chat(server)
    message = expected["choices"][0]["message"]
    resp = client.responses.create(model="thinker", input="t7 t9", max_output_tokens=8,
                                   temperature=0)
    assert [item.type for item in resp.output][0] == "reasoning"
    assert resp.output[0].content[0].text == message["reasoning_content"]
    assert resp.output_text == (message["content"] or "")
    assert resp.usage.output_tokens_details.reasoning_tokens == \
        expected["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    events = list(client.responses.create(model="thinker", input="t7 t9",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == message["reasoning_content"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == message["reasoning_content"]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.done")
    final = events[-1].response
    assert [item.type for item in final.output] == [item.type for item in resp.output]
    # The answer fed back as input (its reasoning item included) is accepted.
    follow = client.responses.create(model="thinker", max_output_tokens=2, temperature=0,
                                     input=[*[i.model_dump(exclude_none=True)
                                              for i in resp.output],
                                            {"role": "user", "content": "t3"}])
    assert follow.status in ("completed", "incomplete")


def test_reasoning_effort_is_the_chat_requests(client: openai.OpenAI) -> None:
    from tokenmill.api.responses_api import _chat_request, plan_response
    from tokenmill.api.responses_protocol import ResponsesRequest

    req = ResponsesRequest(input="t7", reasoning={"effort": "high", "summary": "auto"})
    plan = plan_response(req, [])
    assert _chat_request(plan, plan.messages).reasoning_effort == "high"
    # A model that does not think: a 400 naming the Responses API's field, not a silent drop.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smol", input="hi", max_output_tokens=2,
                                reasoning={"effort": "low"})
    assert "reasoning.effort" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="harmony", input="t7", max_output_tokens=2,
                                reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
    # The next request, and one with an effort for the harmony model, are answered.
    ok = client.responses.create(model="harmony", input="t7", max_output_tokens=2,
                                 temperature=0, reasoning={"effort": "high"})
    assert ok.status in ("completed", "incomplete")
