"""Routes and headers that clients expect of an OpenAI-compatible server: one model by id,
``x-request-id`` on every answer, ``/version``, and prompt scoring with ``max_tokens: 0`` and
``echo`` (lm-evaluation-harness's loglikelihood requests)."""

from __future__ import annotations

import json
import math
import re

import httpx
import openai
import pytest
from server_harness import Server

PROMPT = "The capital of France is Paris"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_retrieve_one_model(client: openai.OpenAI, server: Server) -> None:
    model = client.models.retrieve(server.model)
    assert model.id == server.model and model.object == "model"
    assert client.models.retrieve("all-MiniLM-L6-v2").id == "all-MiniLM-L6-v2"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "no-such-model" in e.value.body["message"]  # type: ignore[index]


def test_every_answer_has_a_request_id(server: Server) -> None:
    mine = httpx.get(f"{server.url}/v1/models", headers={"x-request-id": "trace-42"}, timeout=10)
    assert mine.headers["x-request-id"] == "trace-42"
    new = [httpx.get(f"{server.url}/v1/models", timeout=10).headers["x-request-id"]
           for _ in range(2)]
    assert new[0] != new[1] and all(len(r) >= 16 for r in new)
    # An unusable id (spaces, too long) is replaced, not echoed.
    odd = httpx.get(f"{server.url}/health", headers={"x-request-id": "a b"}, timeout=10)
    assert odd.headers["x-request-id"] not in ("a b", "")
    # Errors and streams carry it too.
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": server.model},
                     headers={"x-request-id": "err-1"}, timeout=10)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "err-1"
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      headers={"x-request-id": "stream-1"},
                      json={"model": server.model, "prompt": "Hi", "max_tokens": 2,
                            "stream": True}) as r:
        assert r.headers["x-request-id"] == "stream-1"
        r.read()


def test_version(server: Server) -> None:
    r = httpx.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json()["version"]


def test_tokenizer_info_is_the_exported_tokenizer_config(server: Server, tmp_path) -> None:
    """vLLM's /tokenizer_info (what lm-eval probes first): tokenizer_config.json's content,
    the same as `tokenmill tokenizer export` writes, for each served model."""
    from tokenmill.model_loader.tokenizer_export import export_tokenizer

    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30)
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert body["eos_token"] == "<|im_end|>" and "<|im_start|>" in body["chat_template"]
    export_tokenizer(None, str(tmp_path))
    exported = json.loads((tmp_path / "tokenizer_config.json").read_text())
    served_len = httpx.get(f"{server.url}/v1/models/{server.model}",
                           timeout=10).json()["max_model_len"]
    assert body == {**exported, "model_max_length": served_len}
    # The embedding model by name; an unknown name is the usual 404.
    bert = httpx.get(f"{server.url}/tokenizer_info", params={"model": "all-MiniLM-L6-v2"},
                     timeout=30).json()
    assert "[CLS]" in {t["content"] for t in bert["added_tokens_decoder"].values()}
    missing = httpx.get(f"{server.url}/tokenizer_info", params={"model": "nope"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_max_tokens_zero_with_echo_scores_the_prompt(client: openai.OpenAI,
                                                     server: Server) -> None:
    scored = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=0,
                                       echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT
    assert scored.usage.completion_tokens == 0
    lps = choice.logprobs
    assert "".join(lps.tokens) == PROMPT
    assert lps.token_logprobs[0] is None and len(lps.token_logprobs) == scored.usage.prompt_tokens
    # The same numbers as the prompt part of an ordinary echo request.
    full = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                     echo=True, logprobs=1, temperature=0)
    n = scored.usage.prompt_tokens
    assert full.choices[0].logprobs.tokens[:n] == lps.tokens
    for a, b in zip(full.choices[0].logprobs.token_logprobs[1:n], lps.token_logprobs[1:],
                    strict=True):
        assert math.isclose(a, b, abs_tol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),                                  # no echo
    ({"max_tokens": 0, "echo": True, "stream": True}, "stream"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_max_tokens_zero_needs_echo_and_no_stream(server: Server, body: dict,
                                                  param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": server.model, "prompt": PROMPT, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_vllm_metrics_through_the_server(client: openai.OpenAI, server: Server) -> None:
    client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
    m = server.metrics(server.model)
    assert m["tokenmill:request_params_max_tokens_count"] >= 1
    assert m["tokenmill:time_per_output_token_seconds_count"] >= 1
    assert m["tokenmill:request_decode_time_seconds_count"] >= 1
    assert m["tokenmill:request_success_total[length]"] >= 1
    assert m["tokenmill:cache_config_info"] == 1
    assert m["tokenmill:iteration_tokens_total_count"] >= 1


def test_start_up_prints_its_progress(server: Server) -> None:
    """What `tokenmill serve` says while it starts: each model as it begins to load, when it
    has loaded, and how long the whole start took."""
    log = server.log()
    first = log.index("loading model 1 of 2: the embedded SmolLM2-135M-Instruct (chat)")
    second = log.index("loading model 2 of 2: the embedded all-MiniLM-L6-v2 (embeddings)")
    assert first < log.index("tokenmill.model_loader: loaded ") < second
    # Notices about the machine, not the model, are said once.
    assert log.count("CPU energy is estimated") <= 1 and log.count("energy: ") <= 1, log
    ready = re.search(r"serving .* on http://127\.0\.0\.1:\d+/v1 \(auth off\); ready "
                      r"(\d+\.\d) s after the process started", log)
    assert ready is not None and 0 < float(ready.group(1)) < 3600, log[-2000:]


def test_usage_reports_prompt_tokens_from_the_prefix_cache(client: openai.OpenAI,
                                                           server: Server) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens (what aiperf and vLLM's clients read):
    0 the first time a prompt is seen, its full blocks the next time; streamed usage too."""
    text = "Describe, in careful detail, the tides of the Bay of Fundy. " * 8  # unique here
    messages = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= again.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=1, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    # Plain completions too (the prompt without the chat template is a new prefix).
    plain = [client.completions.create(model=server.model, prompt=text, max_tokens=1)
             for _ in range(2)]
    assert [p.usage.prompt_tokens_details.cached_tokens > 0 for p in plain] == [False, True]
