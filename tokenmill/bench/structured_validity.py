"""Schema-validity rate through HTTP servers (part of `tokenmill bench structured`).

Each case of the schema set goes, one request at a time, to ``/v1/chat/completions`` with
OpenAI's ``response_format: {"type": "json_schema", ...}``, greedy, with the same
``max_tokens``: to `tokenmill serve` and, given its binary, to llama.cpp's `llama-server` (which
turns ``response_format`` into its ``json_schema`` grammar). The reply's content is parsed with
``json.loads`` and validated with `jsonschema`. Latency is the request's wall time, so each
schema's grammar compilation is inside it, for both servers alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.bench.procs import ServerProcess, free_port, start_server
from tokenmill.bench.structured_set import SchemaCase, score_output

# Seconds one request may take (a slow CPU at batch 1 writing max_tokens tokens).
REQUEST_TIMEOUT_S = 600.0


@dataclass
class CaseResult:
    """One schema's request: what came back, how long it took, and its verdict."""

    name: str
    valid: bool
    parsed: bool
    error: str | None
    finish_reason: str | None
    completion_tokens: int
    prompt_tokens: int
    latency_s: float
    text: str


def chat_body(case: SchemaCase, model: str, max_tokens: int) -> dict[str, Any]:
    """The request of one case: its prompt as the user's message, its schema as the format."""
    return {
        "model": model, "messages": [{"role": "user", "content": case.prompt}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": case.name, "schema": case.schema,
                                            "strict": True}},
        "temperature": 0.0, "max_tokens": max_tokens,
    }


def run_case(client: Any, base_url: str, model: str, case: SchemaCase,
             max_tokens: int) -> CaseResult:
    """Send one case and score its reply (an HTTP error counts as an invalid output)."""
    start = time.perf_counter()
    r = client.post(f"{base_url}/v1/chat/completions", json=chat_body(case, model, max_tokens),
                    timeout=REQUEST_TIMEOUT_S)
    latency = time.perf_counter() - start
    if r.status_code != 200:
        return CaseResult(case.name, False, False, f"HTTP {r.status_code}: {r.text[:300]}",
                          None, 0, 0, latency, "")
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"].get("content") or ""
    usage = body.get("usage") or {}
    verdict = score_output(text, case.schema)
    return CaseResult(case.name, verdict.valid, verdict.parsed, verdict.error,
                      choice.get("finish_reason"), int(usage.get("completion_tokens", 0)),
                      int(usage.get("prompt_tokens", 0)), latency, text)


def run_server_cases(server: ServerProcess, cases: list[SchemaCase],
                     max_tokens: int, label: str) -> dict[str, Any]:
    """Warm the server up with one short plain request, then send every case in turn."""
    import httpx

    from tokenmill.bench.serve import quiet_http_logs, server_model

    quiet_http_logs()
    model = server_model(server.base_url, {})
    results = []
    with httpx.Client() as client:
        client.post(f"{server.base_url}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S,
                    json={"model": model, "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": 8, "temperature": 0.0}).raise_for_status()
        for case in cases:
            res = run_case(client, server.base_url, model, case, max_tokens)
            mark = "valid" if res.valid else f"INVALID ({res.error})"
            print(f"  {label} {case.name}: {res.completion_tokens} tokens, "
                  f"{res.latency_s * 1000:.0f} ms, {mark}", file=sys.stderr)
            results.append(res)
    return summarize(results, server.peak_rss_mib())


def summarize(results: list[CaseResult], peak_rss_mib: float | None) -> dict[str, Any]:
    """Valid and parsed counts, mean latency, completion tokens/s over the whole set."""
    tokens = sum(r.completion_tokens for r in results)
    seconds = sum(r.latency_s for r in results)
    return {
        "cases": len(results), "valid": sum(r.valid for r in results),
        "parsed": sum(r.parsed for r in results),
        "valid_pct": 100 * sum(r.valid for r in results) / len(results),
        "length_cut": sum(r.finish_reason == "length" for r in results),
        "mean_latency_ms": 1000 * statistics.fmean(r.latency_s for r in results),
        "median_latency_ms": 1000 * statistics.median(r.latency_s for r in results),
        "completion_tokens": tokens, "tokens_per_s": tokens / seconds if seconds else None,
        "peak_rss_mib": peak_rss_mib, "results": [asdict(r) for r in results],
    }


def tokenmill_command(port: int, model: str | None, threads: int | None,
                      extra: list[str]) -> list[str]:
    """`tokenmill serve` on ``port`` with the bench's model and threads."""
    cmd = [sys.executable, "-m", "tokenmill", "-q", "serve", "--host", "127.0.0.1",
           "--port", str(port)]
    if model:
        cmd += ["--model", model]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd + extra


def llama_command(binary: str, port: int, model: str, threads: int, ctx: int,
                  extra: list[str]) -> list[str]:
    """`llama-server` with one slot (requests go one at a time) and the model's chat template."""
    return [binary, "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--ctx-size", str(ctx),
            "--parallel", "1", "--jinja", "--no-webui", *extra]


def run_validity(cmd: list[str], port: int, cases: list[SchemaCase], max_tokens: int,
                 label: str) -> dict[str, Any]:
    """Start a server, run the set through it, stop it."""
    print(f"validity: {label}: {' '.join(cmd)}", file=sys.stderr)
    server = start_server(cmd, port)
    try:
        out = run_server_cases(server, cases, max_tokens, label)
    finally:
        server.stop()
    out["command"] = " ".join(cmd)
    return out


def validity_servers(cases: list[SchemaCase], max_tokens: int, model: str, threads: int,
                     tokenmill_extra: list[str], llama_server: str | None,
                     llama_extra: list[str]) -> dict[str, Any]:
    """tokenmill's server, then llama-server's when its binary is given."""
    port = free_port()
    out = {"tokenmill": run_validity(tokenmill_command(port, model, threads, tokenmill_extra),
                                     port, cases, max_tokens, "tokenmill")}
    if llama_server:
        port = free_port()
        cmd = llama_command(llama_server, port, model, threads, 4096, llama_extra)
        out["llama.cpp"] = run_validity(cmd, port, cases, max_tokens, "llama.cpp")
        out["llama.cpp"]["version"] = llama_version(llama_server)
    return out


def llama_version(binary: str) -> str | None:
    """What `llama-server --version` says (its build number and commit)."""
    import subprocess

    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "version" in ln]
    return lines[0].strip() if lines else None
