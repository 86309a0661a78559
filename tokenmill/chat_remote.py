"""`tokenmill chat --url URL` and `tokenmill generate --url URL`: the terminal front ends
talking to a running server through its OpenAI API (like `ollama run` does), streamed.

The answers look the same as the offline ones (tokenmill.chat): text on stdout, a speed summary
on stderr from the stream's usage; a server's refusal (400) becomes a ValueError with its
message. No torch here: these commands start in a fraction of a second.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

from tokenmill.chat import CUT_MARK, Answer, AnswerWriter
from tokenmill.sampling_params import SamplingParams

# Seconds to wait for the server's next bytes (a long prompt's prefill comes first).
READ_TIMEOUT_S = 600.0


class ServerClient:
    """A running server's OpenAI API: its URL, the API key, the model asked for."""

    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(READ_TIMEOUT_S,
                                                                        connect=10.0))
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        """The first model the server lists (GET /v1/models): its default one."""
        data = self._json(self.http.get(f"{self.base}/models"))
        models = [m["id"] for m in data.get("data", [])]
        if not models:
            raise ValueError(f"{self.base}/models lists no model")
        return models[0]

    def _json(self, r: httpx.Response) -> dict[str, Any]:
        if r.status_code >= 400:
            raise ValueError(f"{r.request.url} answered {r.status_code}: {_error_text(r)}")
        return r.json()

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` with stream on and yield each event's JSON."""
        body = {**body, "model": self.model, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", f"{self.base}/{path}", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise ValueError(f"the server answered {r.status_code}: {_error_text(r)}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise ValueError(f"the server failed: {event['error'].get('message')}")
                    yield event
        except httpx.TransportError as e:
            raise ValueError(f"cannot reach the server at {self.base} ({e}); is `tokenmill "
                             "serve` running there?") from None


def _error_text(r: httpx.Response) -> str:
    try:
        return str(r.json().get("error", {}).get("message") or r.text)
    except ValueError:
        return r.text


def request_fields(params: SamplingParams) -> dict[str, Any]:
    """The OpenAI (and vLLM extension) fields of the CLI's sampling options."""
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty, "seed": params.seed,
        "stop": params.stop or None}
    so = params.structured_outputs
    if so is not None:
        body["structured_outputs"] = {k: v for k, v in {
            "json": so.json, "json_object": so.json_object or None, "regex": so.regex,
            "choice": so.choice, "grammar": so.grammar}.items() if v is not None}
    return {k: v for k, v in body.items() if v is not None}


def stream_remote(client: ServerClient, path: str, body: dict[str, Any], out: TextIO) -> Answer:
    """One streamed request, its text written to ``out`` as it comes; what it was."""
    answer = Answer()
    start = time.perf_counter()
    writer = AnswerWriter(out)  # a reasoning model's thinking dimmed and apart
    for event in client.stream(path, body):
        for choice in event.get("choices", []):
            thought = (choice.get("delta") or {}).get("reasoning_content") or ""
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                if answer.first_token_seconds is None:
                    answer.first_token_seconds = time.perf_counter() - start
                answer.text.append(text)
            if thought or text:
                writer.write(thought, text)
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
        if usage := event.get("usage"):
            answer.prompt_tokens = usage.get("prompt_tokens", 0)
            answer.output_tokens = usage.get("completion_tokens", 0)
    writer.close()
    answer.seconds = time.perf_counter() - start
    return answer


class ServerChat:
    """ChatSession's backend on a server: each turn is a streamed /v1/chat/completions."""

    def __init__(self, client: ServerClient, params: SamplingParams) -> None:
        self.client = client
        self.params = params

    def answer(self, messages: list[dict]) -> Answer:
        return stream_remote(self.client, "chat/completions",
                             {**request_fields(self.params), "messages": messages}, sys.stdout)


def run_generate_remote(client: ServerClient, prompt: str, params: SamplingParams) -> int:
    """`tokenmill generate --url`: the answer on stdout, a summary on stderr."""
    answer = stream_remote(client, "completions",
                           {**request_fields(params), "prompt": prompt}, sys.stdout)
    sys.stdout.write("\n")
    if answer.finish_reason == "length":
        print(CUT_MARK, file=sys.stderr)
    print(f"1 request to {client.model}: {answer.prompt_tokens} prompt + {answer.summary()}, "
          f"{answer.seconds:.2f} s in all", file=sys.stderr)
    return 0
