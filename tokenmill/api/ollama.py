"""Ollama's API in OpenAI's terms: the bodies of /api/chat, /api/generate and /api/embed turned
into the OpenAI requests tokenmill already validates and runs, and the OpenAI stream chunks
turned back into Ollama's NDJSON lines (https://github.com/ollama/ollama/blob/main/docs/api.md).

What maps to what:
- ``options``: temperature, top_k, top_p, min_p, seed, num_predict (``max_tokens``; -1 and -2:
  no limit but the context), stop, repeat_penalty (``repetition_penalty``), presence_penalty,
  frequency_penalty. Options that tune Ollama's own runtime (num_ctx, num_thread, num_gpu,
  mirostat...) change nothing here and are accepted; an option of the wrong type is a 400.
- ``format``: ``"json"`` is OpenAI's ``json_object``, a JSON schema its ``json_schema``.
- /api/generate applies the model's chat template to ``system`` + ``prompt`` unless ``raw``.
- ``keep_alive`` is accepted; models stay loaded as the server's own options say.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from pydantic import ValidationError

from tokenmill.api.embeddings import EmbeddingRequest
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.outputs import RequestMetrics

# Ollama option -> OpenAI request field.
OPTION_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "seed": "seed", "stop": "stop",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
# The version /api/version reports: the Ollama API release whose routes and fields these are.
OLLAMA_API_VERSION = "0.6.0"


def _need_dict(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the {what} body must be a JSON object")
    return body


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI sampling fields of an Ollama body's ``options`` and ``format``."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object", "options")
    fields = {OPTION_FIELDS[k]: v for k, v in options.items() if k in OPTION_FIELDS}
    predict = options.get("num_predict")
    if predict is not None:
        if not isinstance(predict, int) or isinstance(predict, bool) or predict < -2:
            raise bad_request(f"options.num_predict must be an integer >= -2, got {predict!r}",
                              "options.num_predict")
        if predict > 0:
            fields["max_tokens"] = predict
        elif predict == 0:
            raise bad_request("options.num_predict 0 generates nothing", "options.num_predict")
    fmt = body.get("format")
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request('format must be "json" or a JSON schema object', "format")
    return fields


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Ollama chat messages as OpenAI's (images are refused: no vision models here)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        if m.get("images"):
            raise bad_request("images are not supported: no served model reads images",
                              f"messages[{i}].images")
        msg = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.get("function", {}).get("name"),
                              "arguments": json.dumps(c.get("function", {}).get("arguments",
                                                                                {}))}}
                for j, c in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def _validated(model: type[Any], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", where) from None


def chat_request(body: Any) -> ChatCompletionRequest:
    """/api/chat as an OpenAI chat request (streamed: Ollama streams unless told not to)."""
    body = _need_dict(body, "/api/chat")
    fields: dict[str, Any] = {"model": body.get("model"),
                              "messages": _messages(body.get("messages")), "stream": True,
                              "stream_options": {"include_usage": True},
                              **sampling_fields(body)}
    if body.get("tools"):
        fields["tools"] = body["tools"]
    return _validated(ChatCompletionRequest, fields)


def generate_request(body: Any) -> ChatCompletionRequest | CompletionRequest:
    """/api/generate: a chat turn (the model's template applied), or with ``raw`` the prompt
    as it is."""
    body = _need_dict(body, "/api/generate")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    if body.get("images"):
        raise bad_request("images are not supported: no served model reads images", "images")
    common = {"model": body.get("model"), "stream": True,
              "stream_options": {"include_usage": True}, **sampling_fields(body)}
    if body.get("raw"):
        return _validated(CompletionRequest, {**common, "prompt": prompt,
                                              "max_tokens": common.get("max_tokens")})
    messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else [])
    messages.append({"role": "user", "content": prompt})
    return _validated(ChatCompletionRequest, {**common, "messages": messages})


def embed_request(body: Any, legacy: bool = False) -> EmbeddingRequest:
    """/api/embed (``input``: a string or a list) or the older /api/embeddings (``prompt``)."""
    body = _need_dict(body, "/api/embeddings" if legacy else "/api/embed")
    key = "prompt" if legacy else "input"
    text = body.get(key)
    if not (isinstance(text, str) or (isinstance(text, list) and text
                                      and all(isinstance(t, str) for t in text))):
        raise bad_request(f"{key} must be a string" + ("" if legacy else " or a list of them"),
                          key)
    fields: dict[str, Any] = {"model": body.get("model"), "input": text}
    if body.get("dimensions") is not None:
        fields["dimensions"] = body["dimensions"]
    return _validated(EmbeddingRequest, fields)


def now_iso() -> str:
    """Ollama's ``created_at``: UTC with nanosecond-style precision."""
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def final_stats(metrics: RequestMetrics | None, prompt_tokens: int,
                output_tokens: int) -> dict[str, Any]:
    """The last line's counts and durations (nanoseconds), from the request's timestamps."""
    def ns(start: float | None, end: float | None) -> int:
        return int((end - start) * 1e9) if start is not None and end is not None else 0

    m = metrics
    return {
        "total_duration": ns(m.arrival_time, m.finished_time) if m else 0,
        "load_duration": 0,  # the model is loaded before any request runs
        "prompt_eval_count": prompt_tokens,
        "prompt_eval_duration": ns(m.first_scheduled_time or m.arrival_time,
                                   m.first_token_time) if m else 0,
        "eval_count": output_tokens,
        "eval_duration": ns(m.first_token_time, m.finished_time) if m else 0,
    }


def tool_calls(openai_calls: list[Any]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as a JSON string) as Ollama's (arguments as an object)."""
    out = []
    for c in openai_calls:
        try:
            args = json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError:
            args = {"_raw": c.function.arguments}
        out.append({"function": {"name": c.function.name, "arguments": args}})
    return out


def ollama_error(err: APIError) -> dict[str, str]:
    """Ollama's error body."""
    return {"error": err.message}
