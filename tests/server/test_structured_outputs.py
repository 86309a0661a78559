"""Structured outputs over HTTP through the official `openai` client: OpenAI's response_format
(also with `parse` and a pydantic model), vLLM's structured_outputs and guided_* fields, on both
endpoints, streamed and whole; each bad constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import Server

TICKET = {
    "type": "object",
    "properties": {
        "queue": {"enum": ["billing", "technical", "sales"]},
        "urgent": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["queue", "urgent", "summary"],
    "additionalProperties": False,
}
ASK = "My invoice charged me twice. Sort this ticket."


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kw):
    kw.setdefault("messages", [{"role": "user", "content": ASK}])
    return client.chat.completions.create(model=None, temperature=0, max_tokens=80, **kw)  # type: ignore[arg-type]


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    r = chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "ticket", "schema": TICKET, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), TICKET)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.beta.chat.completions.parse(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, temperature=0, max_tokens=60)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object_on_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=None, prompt="A JSON object about Paris:",  # type: ignore[arg-type]
                                  max_tokens=120, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("field,value,check", [
    ("structured_outputs", {"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ("structured_outputs", {"choice": ["billing", "sales"]}, lambda t: t in ("billing", "sales")),
    ("structured_outputs", {"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"json": TICKET},
     lambda t: jsonschema.validate(json.loads(t), TICKET) is None),
    ("guided_regex", r"[A-Z]{2}\d{2}", lambda t: re.fullmatch(r"[A-Z]{2}\d{2}", t)),
    ("guided_choice", ["up", "down"], lambda t: t in ("up", "down")),
    ("guided_json", TICKET, lambda t: jsonschema.validate(json.loads(t), TICKET) is None),
    ("guided_grammar", 'root ::= [0-9] [0-9]? "!"', lambda t: re.fullmatch(r"[0-9]{1,2}!", t)),
])
def test_vllm_fields_on_both_endpoints(client: openai.OpenAI, field: str, value, check) -> None:
    c = client.completions.create(model=None, prompt=ASK, max_tokens=80, temperature=0,  # type: ignore[arg-type]
                                  extra_body={field: value})
    assert check(c.choices[0].text), c.choices[0].text
    assert c.choices[0].finish_reason == "stop"
    r = chat(client, extra_body={field: value})
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_streamed_equals_whole(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": TICKET}}
    whole = chat(client, response_format=fmt).choices[0].message.content
    parts, finish = [], None
    for chunk in chat(client, response_format=fmt, stream=True):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole and finish == "stop"


def test_n_samples_each_match(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": ASK}], n=3, temperature=1.0,  # type: ignore[arg-type]
        seed=3, max_tokens=80, extra_body={"guided_json": TICKET})
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), TICKET)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "grammar"),
    ({"guided_json": {"type": "string", "maxLength": 10**9}}, "guided_json", "maxLength"),
    ({"guided_regex": "a{1,99999999}"}, "guided_regex", "repeats"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_constraints_are_400s(server: Server, path: str) -> None:
    base = {"max_tokens": 8, "temperature": 0}
    base |= ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
             else {"prompt": "hi"})
    for extra, param, words in BAD:
        r = httpx.post(f"{server.url}{path}", json=base | extra, timeout=120)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{server.url}{path}", json=base | {"guided_choice": ["yes", "no"]},
                    timeout=120)
    assert ok.status_code == 200
