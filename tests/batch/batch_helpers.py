"""Helpers of the batch tests: engine settings (in Python and on the command line), JSONL files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The engine settings of every batch test; ENGINE_ARGS are the same on the command line. Float
# weights: greedy outputs then do not depend on batch mates, so runs can be compared. One thread
# in a child process: OpenMP threads that share a busy core slow down many times over.
ENGINE_KWARGS: dict[str, Any] = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20,
                                 "quantization": "none"}
ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
               "--quantization", "none", "--threads", "1"]
BATCH_CMD = [sys.executable, "-m", "tokenmill", "-q", "batch", "--no-progress", *ENGINE_ARGS]


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Objects become JSON lines; strings are written as they are (for broken lines)."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def by_custom_id(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Results by custom_id; fails on a repeated one."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        assert r["custom_id"] not in out, f"custom_id {r['custom_id']!r} answered twice"
        out[r["custom_id"]] = r
    return out


def completion(custom_id: str, prompt: Any, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


def chat(custom_id: str, content: str, max_tokens: int = 6, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def texts(result: dict[str, Any]) -> list[str]:
    """The generated texts of one answered line, for either endpoint."""
    body = result["response"]["body"]
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
