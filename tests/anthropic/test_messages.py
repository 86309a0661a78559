"""POST /v1/messages and /v1/messages/count_tokens with the `anthropic` SDK: create, stream,
a tool round trip, thinking with a budget, and the errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from thinking_model import ANTHROPIC_KEY as KEY
from thinking_model import Server

HI = [{"role": "user", "content": "Say hello to Ada."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# The SDK no longer has sampling arguments: they go in the body.
GREEDY = {"temperature": 0}
T5 = {"logit_bias": {"5": 100.0}, **GREEDY}  # the thinking model writes "t5" over and over


def test_create_answers_text_with_usage(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="smol", max_tokens=8, messages=HI, extra_body=GREEDY,
                                 system="You are terse.")
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model="smol", messages=HI, system="You are terse.")
    assert counted.input_tokens == msg.usage.input_tokens > 0


def test_stream_adds_up_to_the_whole_answer(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="smol", max_tokens=12, messages=HI, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(model="smol", max_tokens=12, messages=HI,
                                extra_body=GREEDY) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw = [k for k in kinds if k not in ("text",)]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_give_the_sequence(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="smol", max_tokens=12, messages=HI, extra_body=GREEDY)
    word = whole.content[0].text.split()[1]
    msg = client.messages.create(model="smol", max_tokens=12, messages=HI, extra_body=GREEDY,
                                 stop_sequences=[word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert word not in msg.content[0].text


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model="smol", max_tokens=60, messages=ask, extra_body=GREEDY,
                                 tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    call = next(b for b in msg.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict)
    assert isinstance(call.input.get("city"), str) and call.id.startswith("toolu_")
    answer = client.messages.create(model="smol", max_tokens=8, extra_body=GREEDY,
                                    tools=[WEATHER], messages=[*ask, {"role": "assistant", "content": msg.content},
                                              {"role": "user", "content": [{
                                                  "type": "tool_result", "tool_use_id": call.id,
                                                  "content": "Sunny, 24 C"}]}])
    assert answer.content and answer.content[0].type == "text"
    # Streamed, the call's input arrives as input_json_delta pieces that add up to it.
    with client.messages.stream(model="smol", max_tokens=60, messages=ask, extra_body=GREEDY,
                                tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        pieces = [ev.delta.partial_json for ev in s if ev.type == "content_block_delta"
                  and ev.delta.type == "input_json_delta"]
        final = s.get_final_message()
    assert len(pieces) > 1
    assert next(b for b in final.content if b.type == "tool_use").input == call.input


def test_thinking_with_a_budget(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="thinker", max_tokens=8, messages=HI,
                                 thinking={"type": "enabled", "budget_tokens": 3}, extra_body=T5)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "t5 t5 t5" and msg.content[1].text == "t5 t5 t5 t5"
    with client.messages.stream(model="thinker", max_tokens=8, messages=HI,
                                thinking={"type": "enabled", "budget_tokens": 3},
                                extra_body=T5) as s:
        deltas = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    assert deltas == ["thinking_delta"] * 3 + ["text_delta"] * 4
    assert final.content[0].thinking == "t5 t5 t5" and final.content[1].text == "t5 t5 t5 t5"
    off = client.messages.create(model="thinker", max_tokens=3, messages=HI,
                                 thinking={"type": "disabled"}, extra_body=T5)
    assert [b.type for b in off.content] == ["text"]


@pytest.mark.parametrize(("model", "body", "named"), [
    ("smol", {"thinking": {"type": "enabled", "budget_tokens": 2}}, "thinking"),
    ("thinker", {"thinking": {"type": "enabled", "budget_tokens": 9}},
     "thinking.budget_tokens"),
    ("smol", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ("smol", {"messages": [{"role": "assistant", "content": [{"type": "mystery"}]}]},
     "messages[0].content[0].type"),
    ("smol", {"tools": [{"name": "f", "input_schema": {"type": "array"}}]},
     "tools[0].input_schema"),
])
def test_bad_requests_get_anthropic_errors(client: anthropic.Anthropic, server: Server,
                                           model: str, body: dict, named: str) -> None:
    args = {"model": model, "max_tokens": 8, "messages": HI, **body}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**args)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert named in err.value.body["error"]["message"]
    # The next request is answered as before.
    assert client.messages.create(model="smol", max_tokens=2, messages=HI).content


def test_the_key_is_read_from_x_api_key(server: Server) -> None:
    body = {"model": "smol", "max_tokens": 2, "messages": HI}
    ok = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY},
                    timeout=60)
    assert ok.status_code == 200, ok.text
    bearer = httpx.post(f"{server.url}/v1/messages", json=body,
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert bearer.status_code == 200
    bad = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": "nope"},
                     timeout=60)
    assert bad.status_code == 401
    assert bad.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(f"{server.url}/v1/messages", json={"model": "smol"},
                         headers={"x-api-key": KEY}, timeout=60)
    assert missing.status_code == 400 and missing.json()["type"] == "error"
