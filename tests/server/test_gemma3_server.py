"""`tokenmill serve --model gemma3-270m` (the real Gemma 3 270M GGUF, with the CPU's default
quantization) answers through the official `openai` client: a completion, a stream, and the
next request answered as before."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import server_harness
from server_harness import Server, start_server

from tokenmill.presets import GEMMA3_270M

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[Server]:
    # The 270M's start (assembling and reading a 250 MB file, its 262k-token vocabulary) can
    # take minutes on a busy CI machine.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_harness, "START_TIMEOUT_S", 900)
        s = start_server("--model", GEMMA3_270M, "--max-num-seqs", "4")
    yield s
    code = s.stop()
    assert code == 0, s.log()


@pytest.fixture(scope="module")
def client(gemma_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gemma_server.url}/v1", api_key="unused", max_retries=0)


def test_completion_through_the_openai_client(client: openai.OpenAI,
                                              gemma_server: Server) -> None:
    assert "gemma" in gemma_server.model
    r = client.completions.create(model=gemma_server.model, prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    text = r.choices[0].text
    assert "France" in text or "capital" in text, text
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == 6  # <bos> and five words
    # A stream gives the same greedy text; then the next request is answered as before.
    stream = client.completions.create(model=gemma_server.model, prompt=PROMPT,
                                       max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    again = client.completions.create(model=gemma_server.model, prompt=PROMPT,
                                      max_tokens=12, temperature=0)
    assert again.choices[0].text == text
