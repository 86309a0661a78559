"""lm-evaluation-harness's loglikelihood requests, made the way its `local-completions` model
makes them (token-id prompts, echo, max_tokens 0, logprobs), on the repository's
tokenmill_mc20 task: the server picks the same answers, with the same accuracy, as tokenmill's
LLM computes offline (benchmarks/lm_eval_check.py; the README runs lm-eval itself)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
from server_harness import Server

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("lm_eval_check",
                                              ROOT / "benchmarks" / "lm_eval_check.py")
lm_eval_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lm_eval_check)  # type: ignore[union-attr]


def http_loglikelihood(server: Server, context: list[int], continuation: list[int]) -> float:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": context + continuation, "max_tokens": 0,
        "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(context) + len(continuation)
    return sum(lps[len(context):])


def test_lm_eval_requests_pick_what_llm_picks(server: Server) -> None:
    from tokenmill import LLM

    docs = [json.loads(line) for line in open(lm_eval_check.DATA)]
    llm = LLM(max_model_len=512)
    offline = lm_eval_check.offline_scores(llm, docs)
    tok = llm.engine.tokenizer
    right_http = right_offline = 0
    for doc, scores in zip(docs, offline, strict=True):
        context = f"Question: {doc['question']}\nAnswer:"
        ctx = tok.encode(context, add_special_tokens=False)
        served = []
        for choice in doc["choices"]:
            whole = tok.encode(context + " " + choice, add_special_tokens=False)
            served.append(http_loglikelihood(server, ctx, whole[len(ctx):]))
        pick_http = max(range(len(served)), key=served.__getitem__)
        pick_offline = max(range(len(scores)), key=scores.__getitem__)
        assert pick_http == pick_offline, (doc["question"], served, scores)
        right_http += pick_http == doc["answer"]
        right_offline += pick_offline == doc["answer"]
        for a, b in zip(served, scores, strict=True):
            # The server computes a continuation after its cached question (prefix caching),
            # offline all prompts in one batch: int4 kernels for the server's few rows, the
            # dense bf16 matmul for the batch's many, which round differently (up to 0.22
            # apart on these sums through model.forward, 0.28 through the fused C++ stack,
            # whose fp32 glue flips a few bf16 roundings of the kernels' inputs).
            assert abs(a - b) < 0.35
    assert right_http == right_offline
