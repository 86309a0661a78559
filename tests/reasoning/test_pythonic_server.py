"""The pythonic tool-call format end to end (``--tool-call-parser pythonic``: no chat template
names it), on a tiny random model whose template describes the calls: a forced call is
written as a Python list of calls and comes back as calls, whole and streamed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from format_models import make_format_model
from test_tool_formats_server import TOOLS, chat, stream, streamed_calls
from thinking_model import Server, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = make_format_model(Path(tmp_path_factory.mktemp("pythonic")) / "m", "pythonic")
    s = start_server("--model", f"pythonic={path}", "--tool-call-parser", "pythonic",
                     env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    yield s
    assert s.stop() == 0, s.log()


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "ping"}}])
def test_a_forced_pythonic_call(server: Server, choice: Any) -> None:
    tools = [t for t in TOOLS if t["function"]["name"] == "ping"]
    body = chat(server, "pythonic", tools=tools, tool_choice=choice, max_tokens=40,
                logprobs=True)
    choice0 = body["choices"][0]
    written = "".join(t["token"] for t in choice0["logprobs"]["content"])
    assert written.startswith("[ping()]"), written
    assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
    (call,) = choice0["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("ping", {})
    content, names, arguments = streamed_calls(stream(server, "pythonic", tools=tools,
                                                      tool_choice=choice, max_tokens=40))
    assert (content, names, json.loads(arguments)) == ("", ["ping"], {})


def test_a_request_without_tools_is_answered_as_before(server: Server) -> None:
    body = chat(server, "pythonic", max_tokens=5)
    assert body["choices"][0]["message"]["tool_calls"] is None
    assert body["usage"]["completion_tokens"] <= 5
