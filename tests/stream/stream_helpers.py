"""Helpers of the stream tests: the engine settings on both sides, a real redis-server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

# The engine settings of every stream test; ENGINE_ARGS are the same on the command line. Float
# weights: greedy outputs then do not depend on batch mates, so runs can be compared. One thread
# in a child process: OpenMP threads that share a busy core slow down many times over.
ENGINE_KWARGS: dict[str, Any] = {"max_model_len": 512, "kv_cache_memory_bytes": 64 << 20,
                                 "quantization": "none"}
ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", str(64 << 20),
               "--quantization", "none", "--threads", "1"]
MAX_TOKENS = 6
TEMPLATE = "Review: {text}\nThe sentiment of this review (positive or negative) is"
STREAM_CMD = [sys.executable, "-m", "tokenmill", "-q", "stream", *ENGINE_ARGS,
              "--template", TEMPLATE, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
REVIEWS = [
    "I loved every minute of it.", "Terrible, a waste of money.", "Best pizza in town!",
    "The service was slow and rude.", "Absolutely wonderful stay.", "It broke after a day.",
    "Fantastic value, would buy again.", "Boring and far too long.", "A delight for the kids.",
    "Never again.", "Five stars, no doubt.", "The screen cracked on arrival.",
]


def reference_texts(llm, texts: list[str]) -> list[str]:
    """What one in-process greedy run answers for these records."""
    from tokenmill import SamplingParams

    outs = llm.generate([TEMPLATE.format(text=t) for t in texts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


class RedisServer:
    """A throwaway redis-server on 127.0.0.1 (a free port, no persistence)."""

    def __init__(self, workdir: str) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> Any:
        import redis

        client = redis.Redis.from_url(self.url, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def read_results(client: Any, stream: str) -> dict[str, list[dict[str, Any]]]:
    """Every result in an output stream, by input entry id (a list: delivery is at-least-once)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for _, fields in client.xrange(stream):
        out.setdefault(fields["id"], []).append(json.loads(fields["result"]))
    return out
