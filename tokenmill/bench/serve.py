"""`tokenmill bench serve`: a load generator for any OpenAI-compatible server.

It streams ``POST /v1/completions`` requests (``stream_options.include_usage`` for the output
token count, ``ignore_eos`` so output lengths are fixed where the server supports it; without a
usage chunk the content chunks are counted), sends them with Poisson arrivals (or all at once)
under an optional concurrency cap, and reports vLLM's metrics (see :mod:`tokenmill.bench.metrics`)
as a table and a JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.bench.datasets import SampleRequest, load_jsonl, random_requests
from tokenmill.bench.metrics import RequestResult, calculate_metrics, metrics_to_dict, parse_goodput
from tokenmill.bench.report import format_serve_table, now_iso, write_json

# Seconds a stream may stay silent before the request counts as failed.
READ_TIMEOUT_S = 600.0
# Output tokens of the warm-up request: enough to exercise decoding, short enough to be cheap.
WARMUP_MAX_TOKENS = 16


@dataclass
class LoadSpec:
    """One run of the load generator."""

    base_url: str
    model: str
    requests: list[SampleRequest]
    request_rate: float = float("inf")  # requests/s; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    # Also send min_tokens = the output length: fixes output lengths on servers that have
    # min_tokens but no ignore_eos (llama-cpp-python's).
    min_tokens: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    num_warmups: int = 1
    progress: bool = True


def payload(spec: LoadSpec, req: SampleRequest, max_tokens: int) -> dict[str, Any]:
    """The JSON body of one streamed completions request."""
    body: dict[str, Any] = {
        "model": spec.model, "prompt": req.prompt, "max_tokens": max_tokens,
        "temperature": spec.temperature, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.min_tokens:
        body["min_tokens"] = max_tokens
    return {**body, **spec.extra_body}


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The content of a streamed completions (or chat) chunk; '' when it carries none."""
    parts = []
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        parts.append(text or "")
    return "".join(parts)


async def send_request(client: Any, spec: LoadSpec, req: SampleRequest,
                       max_tokens: int | None = None) -> RequestResult:
    """Send one request and time its stream at the client."""
    import httpx

    result = RequestResult(prompt_len=req.prompt_len)
    chunks, usage_tokens, last = 0, None, 0.0
    start = time.perf_counter()
    result.start_time = start
    try:
        body = payload(spec, req, max_tokens or req.output_len)
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"error event: {json.dumps(chunk['error'])[:300]}")
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
        if chunks == 0:
            raise RuntimeError("the stream ended without content")
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.latency, result.end_time, result.success = last - start, last, True
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        result.end_time = time.perf_counter()
    return result


async def arrivals(requests: Sequence[SampleRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[SampleRequest]:
    """Yield requests at Poisson (burstiness 1) or gamma-distributed gaps of mean 1/rate."""
    rng = random.Random(seed)
    for i, req in enumerate(requests):
        if i and rate != float("inf"):
            # gamma(k, 1/(rate k)) has mean 1/rate; k = 1 is the exponential of a Poisson process.
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        yield req


async def _run(spec: LoadSpec) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=spec.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(30.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=spec.base_url, headers=spec.headers, limits=limits,
                                 timeout=timeout) as client:
        for _ in range(spec.num_warmups):
            first = spec.requests[0]
            warm = await send_request(client, spec, first, min(first.output_len, WARMUP_MAX_TOKENS))
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(spec.max_concurrency or len(spec.requests))
        bar = tqdm(total=len(spec.requests), desc="bench serve", unit="req",
                   disable=not spec.progress)

        async def limited(req: SampleRequest) -> RequestResult:
            async with gate:
                r = await send_request(client, spec, req)
            bar.update(1)
            return r

        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(req)) async for req in
                 arrivals(spec.requests, spec.request_rate, spec.burstiness, spec.seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def run_load(spec: LoadSpec) -> tuple[list[RequestResult], float]:
    """Run the load; returns per-request results (in request order) and the wall-clock seconds."""
    if not spec.requests:
        raise ValueError("the workload has no requests")
    if spec.request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {spec.request_rate}")
    if spec.burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {spec.burstiness}")
    if spec.max_concurrency is not None and spec.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {spec.max_concurrency}")
    return asyncio.run(_run(spec))


def benchmark(spec: LoadSpec, percentiles: Sequence[float] = (90.0, 99.0),
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """Run the load and return the result document (vLLM's key names plus the run's settings)."""
    results, duration = run_load(spec)
    m = calculate_metrics(results, duration, percentiles, goodput)
    return {
        "date": now_iso(), "backend": "openai-completions", "base_url": spec.base_url,
        "model": spec.model, "num_prompts": len(spec.requests),
        "request_rate": "inf" if spec.request_rate == float("inf") else spec.request_rate,
        "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency,
        "seed": spec.seed, "ignore_eos": spec.ignore_eos, "min_tokens": spec.min_tokens,
        "goodput_slos_ms": goodput or None,
        **metrics_to_dict(m),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "errors": [r.error for r in results],
    }


def server_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model id the server lists at /v1/models."""
    import httpx

    r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def build_requests(args: argparse.Namespace, base_url: str, model: str,
                   headers: dict[str, str]) -> list[SampleRequest]:
    """The workload: the server's tokenizer when it has tokenize routes, else a local one."""
    from tokenmill.bench.codec import LocalCodec, RemoteCodec

    codec = None if args.tokenizer else RemoteCodec.probe(base_url, model, headers)
    if codec is None:
        print(f"tokenizing locally with {args.tokenizer or 'the embedded model'}", file=sys.stderr)
        codec = LocalCodec(args.tokenizer)
    if args.dataset == "random":
        return random_requests(codec, args.num_prompts, args.input_len, args.output_len,
                               args.seed)
    return load_jsonl(args.dataset, args.num_prompts, args.output_len, args.seed, codec)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Workload and arrival options shared by `bench serve` and `bench compare`."""
    p.add_argument("--dataset", default="random",
                   help="'random' or a JSONL file of {prompt | prompt_token_ids, output_len?}")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 100 random, or every line of the file)")
    p.add_argument("--input-len", default="128", help="prompt tokens: N or MIN:MAX (random)")
    p.add_argument("--output-len", default="128", help="output tokens: N or MIN:MAX")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf (default) sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder to tokenize with locally (default: the server's "
                        "/tokenize, else the embedded model)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end early)")
    p.add_argument("--min-tokens", action="store_true",
                   help="also send min_tokens = output length (servers without ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:20000")
    p.add_argument("--metric-percentiles", default="90,99",
                   help="comma-separated percentiles to report (besides mean and median)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench serve`."""
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP",
                              description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root, without /v1")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--num-warmups", type=int, default=1, help="untimed iterations first")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    add_load_args(p)
    p.set_defaults(func=cmd_serve)


def quiet_http_logs() -> None:
    """httpx logs every request at INFO: thousands of lines under load."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run `tokenmill bench serve`."""
    quiet_http_logs()
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or server_model(base_url, headers)
    num = args.num_prompts or (100 if args.dataset == "random" else None)
    args.num_prompts = num
    requests = build_requests(args, base_url, model, headers)
    spec = LoadSpec(base_url=base_url, model=model, requests=requests,
                    request_rate=args.request_rate, burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, seed=args.seed,
                    ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                    temperature=args.temperature,
                    extra_body=args.extra_body, headers=headers, num_warmups=args.num_warmups,
                    progress=args.progress)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    result = benchmark(spec, percentiles, parse_goodput(args.goodput))
    result["dataset"] = args.dataset
    result["command"] = " ".join(["tokenmill", *sys.argv[1:]])
    print(format_serve_table(result, percentiles))
    if args.result_file:
        write_json(args.result_file, result)
    return 0 if result["completed"] else 1
