"""Speculative decoding through the HTTP server: on for every request, or off for one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_harness import Server, start_server

DRAFTS = "tokenmill:spec_decode_num_drafts_total"
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9,"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--speculative", "ngram", "--num-speculative-tokens", "3")
    yield s
    s.stop()


def complete(server: Server, **extra: object) -> str:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_requests_speculate_unless_they_opt_out(server: Server) -> None:
    before = server.metrics().get(DRAFTS, 0.0)
    plain = complete(server, speculative=False)
    assert server.metrics().get(DRAFTS, 0.0) == before
    speculated = complete(server)
    assert server.metrics()[DRAFTS] > before
    assert len(speculated) > 0 and len(plain) > 0
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": server.model, "prompt": "hi", "speculative": "maybe"})
    assert r.status_code == 400 and "speculative" in r.text
