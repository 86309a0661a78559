"""OpenAI semantics through the official `openai` client against a real server process."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import Server

CHAT = [{"role": "user", "content": "Name three rivers."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def tokenize(server: Server, **body: object) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models(client: openai.OpenAI, server: Server) -> None:
    # The default server: the embedded chat model first, then the embedded embedding model.
    models = client.models.list().data
    assert [m.id for m in models] == [server.model, "all-MiniLM-L6-v2"]


def test_chat_stream_equals_non_stream(client: openai.OpenAI, server: Server) -> None:
    whole = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=24,
                                           temperature=0)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.created > 1_600_000_000
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT,
                                                 max_tokens=24, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert streamed
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_equals_non_stream(client: openai.OpenAI, server: Server) -> None:
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                      temperature=0)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_usage_matches_tokenizer(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                    temperature=0, logprobs=0)
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert out.usage.completion_tokens == len(out.choices[0].logprobs.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8,
                                          temperature=0, logprobs=True)
    assert chat.usage.prompt_tokens == len(tokenize(server, messages=CHAT))
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content)


def test_stream_include_usage(client: openai.OpenAI, server: Server) -> None:
    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(tokenize(server, messages=CHAT))


def test_n2(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8, n=2,
                                         temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 16
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, n=2,
                                            temperature=1.0, seed=3, stream=True))
    assert {ch.index for c in chunks for ch in c.choices} == {0, 1}
    finishes = [ch for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(ch.index for ch in finishes) == [0, 1]


def test_seed_reproducible(client: openai.OpenAI, server: Server) -> None:
    texts = [client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                       temperature=1.0, seed=42).choices[0].text
             for _ in range(2)]
    assert texts[0] == texts[1]


def test_stop(client: openai.OpenAI, server: Server) -> None:
    free = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                    temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_chat_logprobs(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


def test_completion_logprobs_and_echo(client: openai.OpenAI, server: Server) -> None:
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                    temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[n_prompt] == len(PROMPT)


def test_completion_prompt_forms(client: openai.OpenAI, server: Server) -> None:
    ids = tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                        temperature=0)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=server.model, prompt=[PROMPT, "def fib(n):"],
                                     max_tokens=6, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == by_text.choices[0].text
    batch_ids = client.completions.create(model=server.model, prompt=[ids, ids], max_tokens=6,
                                          temperature=0)
    assert [c.text for c in batch_ids.choices] == [by_text.choices[0].text] * 2


def test_sampling_extras_and_max_completion_tokens(client: openai.OpenAI, server: Server) -> None:
    out = client.chat.completions.create(
        model=server.model, messages=CHAT, max_completion_tokens=5, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"11": -100}, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"


def test_logit_bias_forces_token(client: openai.OpenAI, server: Server) -> None:
    target = tokenize(server, prompt=" banana")[0]
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                    temperature=0, logit_bias={str(target): 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [" banana"] * 3


def test_tokenize_detokenize(server: Server) -> None:
    ids = tokenize(server, prompt=PROMPT)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=10)
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT


def test_best_of_returns_the_most_likely_samples(client: openai.OpenAI, server: Server) -> None:
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    best = client.completions.create(n=1, best_of=4, logprobs=0, **kw)
    every = client.completions.create(n=4, logprobs=0, **kw)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    # The same seeds: the best of 4 is the most likely of the 4 plain samples.
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    assert best.choices[0].text == max(totals, key=totals.__getitem__)
    assert best.usage.completion_tokens == 4 * 6  # every sample generated counts
    without_lps = client.completions.create(n=2, best_of=3, **kw)
    assert len(without_lps.choices) == 2 and without_lps.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=2, best_of=1, **kw)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=1, best_of=2, stream=True, **kw)


def test_prefix_cache_hits_are_counted(client: openai.OpenAI, server: Server) -> None:
    prompt = "You are a careful assistant. " * 12 + "Say something."
    before = server.metrics()
    for _ in range(2):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    after = server.metrics()
    hits = "tokenmill:prefix_cache_hits_total"
    queries = "tokenmill:prefix_cache_queries_total"
    assert after[queries] - before.get(queries, 0.0) >= 2 * 60
    assert after[hits] - before.get(hits, 0.0) >= 48  # the second request's whole blocks
    assert 0 < after["tokenmill:prefix_cache_hit_rate"] == after[hits] / after[queries]
