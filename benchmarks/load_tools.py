"""aiperf and guidellm against `tokenmill serve`, each from its own virtual environment, with
the tokenizer that `tokenmill tokenizer export` writes (both tools count tokens with a Hugging
Face tokenizer, which a GGUF model does not come with and an offline machine cannot download).

The script keeps them working: it makes the environments when they are missing (`pip install
-c constraints.txt aiperf` / `guidellm`: both downgrade packages tokenmill shares, so never
into tokenmill's own environment), starts the default server on a free port, runs the same
workload through aiperf, guidellm and `tokenmill bench serve`, fails unless every request of
every tool completed without an error, and prints and writes what each tool reported.

    python benchmarks/load_tools.py [--venvs DIR] [--requests 32] [--concurrency 8]
        [--input-len 128] [--output-len 64] [--result-file FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from typing import Any

from tokenmill.bench.procs import free_port, start_server
from tokenmill.bench.report import hardware, hardware_line, markdown_table, now_iso, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOOL_TIMEOUT_S = 1800


def venv(root: str, package: str) -> str:
    """The bin folder of ``root/package``, made (and the package installed) if missing."""
    bin_dir = os.path.join(root, package, "bin")
    if not os.path.exists(os.path.join(bin_dir, package)):
        subprocess.run([sys.executable, "-m", "venv", os.path.join(root, package)], check=True)
        subprocess.run([os.path.join(bin_dir, "pip"), "install", "-q", "-c",
                        os.path.join(ROOT, "constraints.txt"), package], check=True)
    return bin_dir


def run_tool(cmd: list[str], env: dict[str, str] | None = None) -> float:
    """Run one tool; its output goes to ours, a failure raises with the command. The CPU
    seconds it and its child processes used: on a small machine the client takes cores from
    the server it measures."""
    print("$", " ".join(cmd), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, timeout=TOOL_TIMEOUT_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} exited with {proc.returncode}")
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def aiperf(bin_dir: str, url: str, tok: str, out: str, a: argparse.Namespace) -> dict[str, Any]:
    # No HF_HUB_OFFLINE: in offline mode aiperf 0.13 looks a local tokenizer folder up in the
    # Hub cache by name and fails; a path is loaded from disk without the Hub either way.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                           "TRANSFORMERS_OFFLINE")}
    cpu = run_tool([os.path.join(bin_dir, "aiperf"), "profile", "--model", MODEL, "--url", url,
              "--endpoint-type", "chat", "--streaming", "--tokenizer", tok,
              "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
              "--prompt-input-tokens-mean", str(a.input_len), "--prompt-input-tokens-stddev", "0",
              "--prompt-output-tokens-mean", str(a.output_len),
              "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
              "--random-seed", "0", "--output-artifact-dir", out, "--no-gpu-telemetry",
              "--ui-type", "simple"], env)
    with open(os.path.join(out, "profile_export_aiperf.json"), encoding="utf-8") as f:
        r = json.load(f)
    completed = int(r["request_count"]["avg"])
    if completed != a.requests or r["error_summary"] or not r["is_complete"]:
        raise SystemExit(f"aiperf: {completed} of {a.requests} requests, errors "
                         f"{r['error_summary']}")
    return {"completed": completed, "errors": 0, "client_cpu_s": cpu,
            "output_tok_s": r["output_token_throughput"]["avg"],
            "ttft_median_ms": r["time_to_first_token"]["p50"],
            "itl_median_ms": r["inter_token_latency"]["p50"],
            "prompt_tokens_per_request": r["usage_prompt_tokens"]["avg"],
            "output_tokens_per_request": r["usage_completion_tokens"]["avg"]}


def guidellm(bin_dir: str, url: str, tok: str, out: str,
             a: argparse.Namespace) -> dict[str, Any]:
    path = os.path.join(out, "benchmarks.json")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cpu = run_tool([os.path.join(bin_dir, "guidellm"), "run",
              "--backend", f"kind=openai_http,target={url},model={MODEL},"
                           "request_format=/v1/chat/completions",
              "--profile", f"kind=concurrent,streams={a.concurrency}",
              "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},"
                        f"output_tokens={a.output_len}",
              "--constraint", f"kind=max_requests,count={a.requests}",
              "--tokenizer", f"kind=huggingface_auto,model={tok}",
              "--output", f"kind=json,path={path}", "--output", "kind=console",
              "--disable-progress"], env)
    with open(path, encoding="utf-8") as f:
        m = json.load(f)["benchmarks"][0]["metrics"]
    totals = m["request_totals"]
    if totals["successful"] != a.requests or totals["errored"] or totals["incomplete"]:
        raise SystemExit(f"guidellm: {totals}")

    def median(name: str) -> float:
        return m[name]["successful"]["median"]

    return {"completed": totals["successful"], "errors": 0, "client_cpu_s": cpu,
            # The server-wide rate (guidellm's "Output Tokens Per Sec" column), not the
            # per-request median it also keeps.
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_median_ms": median("time_to_first_token_ms"),
            "itl_median_ms": median("inter_token_latency_ms"),
            "prompt_tokens_per_request": median("prompt_token_count"),
            "output_tokens_per_request": median("output_token_count")}


def tokenmill_bench(url: str, out: str, a: argparse.Namespace) -> dict[str, Any]:
    path = os.path.join(out, "serve.json")
    cpu = run_tool([sys.executable, "-m", "tokenmill", "-q", "bench", "serve", "--base-url", url,
              "--dataset", "random", "--num-prompts", str(a.requests), "--input-len",
              str(a.input_len), "--output-len", str(a.output_len), "--max-concurrency",
              str(a.concurrency), "--request-rate", "inf", "--seed", "0",
              "--result-file", path])
    with open(path, encoding="utf-8") as f:
        r = json.load(f)
    if r["completed"] != a.requests or r["failed"]:
        raise SystemExit(f"tokenmill bench serve: {r['completed']} completed, {r['failed']} "
                         "failed")
    return {"completed": r["completed"], "errors": 0, "client_cpu_s": cpu,
            "output_tok_s": r["output_throughput"], "ttft_median_ms": r["median_ttft_ms"],
            "itl_median_ms": r["median_itl_ms"],
            "prompt_tokens_per_request": r["total_input_tokens"] / r["completed"],
            "output_tokens_per_request": r["total_output_tokens"] / r["completed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venvs", default=os.path.join(HERE, ".venv-tools"),
                    help="folder of the tools' virtual environments (made if missing)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--result-file", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    bins = {tool: venv(a.venvs, tool) for tool in ("aiperf", "guidellm")}
    work = tempfile.mkdtemp(prefix="tm-load-tools-")
    tok = os.path.join(work, "tokenizer")
    subprocess.run([sys.executable, "-m", "tokenmill", "-q", "tokenizer", "export", tok],
                   check=True)
    port = free_port()
    server = start_server([sys.executable, "-m", "tokenmill", "serve", "--port", str(port)],
                          port)
    results: dict[str, dict[str, Any]] = {}
    try:
        results["aiperf"] = aiperf(bins["aiperf"], server.base_url, tok,
                                   os.path.join(work, "aiperf"), a)
        results["guidellm"] = guidellm(bins["guidellm"], server.base_url, tok,
                                       os.path.join(work, "guidellm"), a)
        results["tokenmill bench serve"] = tokenmill_bench(server.base_url, work, a)
    finally:
        code = server.stop()
    if code != 0:
        raise SystemExit(f"the server exited with {code}")
    hw = hardware()
    rows = [[tool, r["completed"], r["errors"], r["output_tok_s"], r["ttft_median_ms"],
             r["itl_median_ms"], r["prompt_tokens_per_request"], r["output_tokens_per_request"],
             r["client_cpu_s"]]
            for tool, r in results.items()]
    print(f"\n{hardware_line(hw)}; {a.requests} requests, {a.concurrency} at a time, "
          f"{a.input_len} + {a.output_len} tokens")
    print(markdown_table(["tool", "completed", "errors", "output tok/s", "median TTFT ms",
                          "median ITL ms", "prompt tokens", "output tokens", "client CPU s"],
                         rows))
    if a.result_file:
        write_json(a.result_file, {"created": now_iso(), "hardware": hw, "workload": {
            "requests": a.requests, "concurrency": a.concurrency, "input_len": a.input_len,
            "output_len": a.output_len}, "results": results})


if __name__ == "__main__":
    main()
