"""The offline `tokenmill chat`: a reasoning model's thinking is shown apart ("(thinking) ...")
and kept out of the conversation, as `tokenmill chat --url` does; a model that does not think
is shown and remembered as before. The engine is a stand-in that replays set pieces of text."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import pytest

from tokenmill.chat import AnswerWriter, ChatSession, EngineChat
from tokenmill.sampling_params import SamplingParams

THINKING_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<think>"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class _Tokenizer:
    chat_template: str

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list]:
        text = "".join(m["content"] for m in messages)
        return text + ("<think>" if "<think>" in self.chat_template else ""), [1, 2, 3]


@dataclass
class _Engine:
    """Replays ``pieces`` as one request's streamed text, one piece per step."""

    tokenizer: _Tokenizer
    pieces: list[str]
    params: list[SamplingParams] = field(default_factory=list)
    _rid: str = ""
    _left: list[str] = field(default_factory=list)

    def add_request(self, rid: str, prompt: Any, params: SamplingParams, kind: Any) -> None:
        self._rid, self._left = rid, list(self.pieces)
        self.params.append(params)

    def has_unfinished_requests(self) -> bool:
        return bool(self._left)

    def step(self) -> list[_Output]:
        piece = self._left.pop(0)
        done = not self._left
        return [_Output(self._rid, [_Completion(piece, [7], "stop" if done else None)],
                        [1, 2, 3], done)]

    def abort_request(self, rid: str) -> None:
        self._left = []


def _say(engine: _Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ChatSession]:
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    session = ChatSession(EngineChat(engine, SamplingParams(max_tokens=16)), None)  # type: ignore[arg-type]
    session.say("hi")
    return out.getvalue(), session


def test_thinking_is_shown_apart_and_kept_out_of_the_conversation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine(_Tokenizer(THINKING_TEMPLATE),
                     ["The user ", "greets.</th", "ink>\n\nHello", " there!"])
    shown, session = _say(engine, monkeypatch)
    assert shown == "(thinking) The user greets.\n\nHello there!\n"
    assert session.history[-1] == {"role": "assistant", "content": "Hello there!"}
    assert "<think>" not in shown and "</think>" not in shown


def test_a_model_that_does_not_think_is_shown_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine(_Tokenizer(PLAIN_TEMPLATE), ["Hello", " <b>there</b>!"])
    shown, session = _say(engine, monkeypatch)
    assert shown == "Hello <b>there</b>!\n"
    assert session.history[-1] == {"role": "assistant", "content": "Hello <b>there</b>!"}
    assert engine.params[0].skip_special_tokens  # left as the user set it


def test_an_answer_cut_inside_its_thinking_ends_the_dim_text() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    writer = AnswerWriter(out)
    writer.write("still thinking", "")
    writer.close()
    assert out.getvalue() == "\x1b[2m(thinking) still thinking\x1b[0m\n"


def test_chat_url_shows_the_servers_reasoning_content_the_same_way() -> None:
    from tokenmill.chat_remote import stream_remote

    class Client:
        def stream(self, path: str, body: dict) -> Any:
            yield {"choices": [{"delta": {"reasoning_content": "The user greets."}}]}
            yield {"choices": [{"delta": {"content": "Hello"}}]}
            yield {"choices": [{"delta": {"content": " there!"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 6}}

    out = io.StringIO()
    answer = stream_remote(Client(), "/v1/chat/completions", {}, out)  # type: ignore[arg-type]
    assert out.getvalue() == "(thinking) The user greets.\n\nHello there!"
    assert "".join(answer.text) == "Hello there!" and answer.finish_reason == "stop"
    assert answer.output_tokens == 6
