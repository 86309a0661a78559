"""The OpenAI-compatible server on a real GPU: concurrent streams, a stop string, a JSON
schema and a client that hangs up mid-stream, on the CUDA defaults (Triton attention, CUDA
graphs, asynchronous scheduling), against the same server run eagerly and step by step.
tiny-llama with dummy fp32 weights: a GPU run carries no model file. Only httpx talks to it
(the device image has no openai client). Skips without CUDA (CI has none); tests/server
runs the same kinds of requests on the CPU."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from server_harness import Server, idle, leave_mid_stream, start_server, wait_for  # noqa: E402

DEVICE = "cuda"
MODEL = ["--model", "tiny-llama", "--load-format", "dummy", "--dtype", "float32",
         "--max-num-seqs", "8"]
PROMPTS = [f"Story {i}: once upon a time" for i in range(6)]
# Bounded values: a random model would write a free string or number until max_tokens.
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ann", "bob"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


async def _stream(http: httpx.AsyncClient, server: Server, i: int) -> tuple[str, str]:
    body = {"model": server.model, "prompt": PROMPTS[i], "max_tokens": 12 + 4 * i,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    if i == 3:
        body["stop"] = [" the"]
    text, finish = "", ""
    async with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:])["choices"]:
                text += choice["text"]
                finish = choice.get("finish_reason") or finish
    return text, finish


async def _structured(http: httpx.AsyncClient, server: Server) -> tuple[str, str]:
    body = {"model": server.model, "max_tokens": 60, "temperature": 0.0,
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}}
    resp = await http.post(f"{server.url}/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


async def _run(server: Server) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(timeout=120) as http:
        results = await asyncio.gather(leave_mid_stream(server), _structured(http, server),
                                       *[_stream(http, server, i) for i in range(6)])
    return list(results[1:])


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    started = {}
    try:
        started["eager"] = start_server("--device", DEVICE, *MODEL, "--enforce-eager",
                                        "--no-async-scheduling")
        started["default"] = start_server("--device", DEVICE, *MODEL)
        yield started
    finally:
        for s in started.values():
            assert s.stop() == 0, s.log()


def test_the_cuda_server_streams_what_the_eager_step_by_step_server_streams(
        servers: dict[str, Server]) -> None:
    assert "asynchronous scheduling: on" in servers["default"].log()
    assert "decode CUDA graphs captured" in servers["default"].log()
    expected = asyncio.run(_run(servers["eager"]))
    got = asyncio.run(_run(servers["default"]))
    assert got == expected
    content, finish = got[0]
    person = json.loads(content)  # the grammar held on the device's logits
    assert finish == "stop" and person["name"] in ("ann", "bob")
    assert isinstance(person["ok"], bool)
    # (Whether the random model writes the stop string is up to its weights.)
    assert {f for _, f in got[1:]} <= {"length", "stop"}
    # The client that hung up was aborted: nothing is left running, no block is held.
    for server in servers.values():
        assert wait_for(lambda server=server: idle(server)), server.log()
