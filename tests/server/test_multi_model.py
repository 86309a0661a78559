"""Several models in one server: listed, routed by `model`, requests to both interleaved,
unknown names a 404, metrics per model, one KV budget."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import Server, start_server

from tokenmill.model_loader.gguf import embedded_model_path


@pytest.fixture(scope="module")
def two() -> Iterator[Server]:
    path = embedded_model_path()
    s = start_server("--model", f"chat={path}", "--model",
                     f"short={path},max-model-len=256,kv-share=3,cost-per-hour=0",
                     "--cost-per-hour", "36")
    yield s
    assert s.stop() == 0, s.log()


def test_both_models_are_listed_with_their_own_options(two: Server) -> None:
    client = openai.OpenAI(base_url=f"{two.url}/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"chat", "short"}
    assert models["chat"].model_extra["max_model_len"] == 512  # the command line's
    assert models["short"].model_extra["max_model_len"] == 256  # its own


def test_requests_to_both_interleave(two: Server) -> None:
    client = openai.OpenAI(base_url=f"{two.url}/v1", api_key="x")

    def ask(i: int) -> tuple[str, str, str]:
        model = ("chat", "short")[i % 2]
        r = client.completions.create(model=model, prompt=f"{i} + {i} =", max_tokens=6,
                                      temperature=0)
        return model, r.model, r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(12)))
    assert all(asked == answered for asked, answered, _ in answers)
    # The same weights: greedy answers agree whichever engine gave them.
    alone = {i: client.completions.create(model="chat", prompt=f"{i} + {i} =", max_tokens=6,
                                          temperature=0).choices[0].text for i in range(2)}
    assert answers[0][2] == alone[0] and answers[1][2] == alone[1]
    # No model: the first one.
    r = httpx.post(f"{two.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "chat"
    per_model = {m: two.metrics(model=m)["tokenmill:generation_tokens_total"]
                 for m in ("chat", "short")}
    assert per_model["chat"] >= 6 * 6 and per_model["short"] >= 6 * 6


def test_unknown_model_is_a_404_and_the_next_request_works(two: Server) -> None:
    client = openai.OpenAI(base_url=f"{two.url}/v1", api_key="x")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'chat', 'short'" in e.value.message
    r = httpx.post(f"{two.url}/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert client.completions.create(model="short", prompt="x", max_tokens=2).model == "short"


def test_each_model_has_its_own_kv_cache_from_one_budget(two: Server) -> None:
    text = two.log()
    sizes = [line for line in text.splitlines() if "KV cache:" in line]
    assert len(sizes) == 2
    mib = [float(line.split("(")[1].split(" MiB")[0]) for line in sizes]
    # --kv-cache-memory (128 MiB, the harness's) split 1:3.
    assert mib == [32, 96]


def test_usage_and_metrics_carry_compute_energy_and_cost(two: Server) -> None:
    """Each response's usage has its compute share, energy (estimated on this machine) and
    cost (by each model's own --cost-per-hour); /metrics has the totals per model."""
    for model, priced in (("chat", True), ("short", False)):
        r = httpx.post(f"{two.url}/v1/completions", timeout=60, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0}).json()["usage"]
        assert r["compute_seconds"] > 0 and r["energy_joules"] > 0
        assert (r["cost_usd"] > 0) == priced
        assert r["cost_usd"] == pytest.approx(r["compute_seconds"] * 36 / 3600 if priced else 0,
                                              rel=1e-3, abs=1e-9)
    chunks = httpx.post(f"{two.url}/v1/chat/completions", timeout=60, json={
        "model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}}).text
    assert '"energy_joules"' in chunks and '"compute_seconds"' in chunks
    m = two.metrics(model="chat")
    assert m["tokenmill:energy_joules_total"] > 0 and m["tokenmill:cost_usd_total"] > 0
    assert m["tokenmill:joules_per_output_token"] > 0
    assert m["tokenmill:compute_seconds_total"] > 0
    estimated = m["tokenmill:energy_estimated"] == 1
    assert estimated == r["energy_estimated"]
    assert two.metrics(model="short")["tokenmill:cost_usd_total"] == 0
