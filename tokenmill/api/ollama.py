"""Ollama's API in OpenAI's terms: the bodies of /api/chat, /api/generate and /api/embed turned
into the OpenAI requests tokenmill already validates and runs, and the OpenAI stream chunks
turned back into Ollama's NDJSON lines (https://github.com/ollama/ollama/blob/main/docs/api.md).

What maps to what:
- ``options``: temperature, top_k, top_p, min_p, seed, num_predict (``max_tokens``; -1 and -2:
  no limit but the context; absent: ``DEFAULT_NUM_PREDICT``, within the context left), stop, repeat_penalty (``repetition_penalty``), presence_penalty,
  frequency_penalty. Options that tune Ollama's own runtime (num_ctx, num_thread, num_gpu,
  mirostat...) change nothing here and are accepted; an option of the wrong type is a 400.
- ``format``: ``"json"`` is OpenAI's ``json_object``, a JSON schema its ``json_schema``.
- /api/generate applies the model's chat template to ``system`` + ``prompt`` unless ``raw``.
  Its last line carries ``context``: the token ids of prompt and answer, which a client may
  send back as ``context`` to continue from them (the new prompt's ids follow them).
- ``keep_alive`` is accepted; models stay loaded as the server's own options say.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

from pydantic import ValidationError

from tokenmill.api.chat import MAX_CHARS_PER_TOKEN, ChatCall, render_prompt
from tokenmill.api.completions import CompletionCall
from tokenmill.api.embeddings import EmbeddingRequest
from tokenmill.api.endpoints import prepare
from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.api.reasoning import ReasoningSetup, resolve_reasoning_parser
from tokenmill.api.validation import ServedModel, check_token_ids
from tokenmill.outputs import RequestMetrics

# Ollama option -> OpenAI request field.
OPTION_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "seed": "seed", "stop": "stop",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
# The version /api/version reports: the Ollama API release whose routes and fields these are.
OLLAMA_API_VERSION = "0.6.0"
# The most tokens a request without ``num_predict`` generates (fewer when the context has less
# room). Ollama's default, -1, runs until its context window is full, and that window is
# small (``num_ctx``: 2,048 tokens in this API version); a model here may have 32,768.
DEFAULT_NUM_PREDICT = 2048


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
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, function name) of calls not yet answered
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        if m.get("images"):
            raise bad_request("images are not supported: no served model reads images",
                              f"messages[{i}].images")
        msg = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls", i)
            pending = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        elif m.get("role") == "tool" and "tool_call_id" not in m and pending:
            # Ollama's tool results name no call id (at most the function, ``tool_name``):
            # each answers the earliest unanswered call of the assistant turn before it.
            named = [p for p in pending if p[1] == m.get("tool_name")] or pending
            msg["tool_call_id"] = named[0][0]
            pending.remove(named[0])
        out.append(msg)
    return out


def _tool_calls(raw: Any, where: str, i: int) -> list[dict[str, Any]]:
    """Ollama's ``[{"function": {"name", "arguments": {...}}}]`` as OpenAI's tool calls."""
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list of objects", where)
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict):
            raise bad_request(f'{where}[{j}] must be an object with a "function" object',
                              f"{where}[{j}]")
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where}[{j}].function.name must be a non-empty string",
                              f"{where}[{j}].function.name")
        if not isinstance(args, dict):
            raise bad_request(f"{where}[{j}].function.arguments must be an object",
                              f"{where}[{j}].function.arguments")
        calls.append({"id": f"call_{i}_{j}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
    return calls


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


def context_ids(body: dict[str, Any]) -> list[int] | None:
    """/api/generate's ``context``: the token ids an earlier answer returned (None: absent or
    empty); 400 unless a list of integers (the vocabulary is checked in ``prepare_ollama``)."""
    raw = body.get("context")
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise bad_request("context must be a list of token ids (integers), as an earlier "
                          "/api/generate answer returned it", "context")
    return raw


def prepare_ollama(req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any],
                   served: ServedModel, context: list[int] | None = None,
                   **options: Any) -> ChatCall | CompletionCall:
    """``prepare`` (``options``: its keywords) of the request an Ollama body became, the
    ``context`` token ids (validated against the vocabulary) before its prompt, and
    ``DEFAULT_NUM_PREDICT`` when the body's options set no ``num_predict``."""
    if context is not None:
        check_token_ids(context, served.vocab_size, "context")
        req = _continued(req, context, served)
    if isinstance(req, ChatCompletionRequest):
        req = _thinking(req, body.get("think"), served, options.get("reasoning"))
    call = prepare(req, served, **options)
    if isinstance(call, ChatCall) and call.tools is not None:
        call.tools.whole_calls = True  # Ollama streams each call whole
    if (body.get("options") or {}).get("num_predict") is None and call.params.max_tokens is None:
        room = served.max_model_len - max(len(ids) for ids in _prompt_ids(call))
        call.params = dataclasses.replace(call.params,
                                          max_tokens=min(DEFAULT_NUM_PREDICT, room))
    return call


def _thinking(req: ChatCompletionRequest, think: Any, served: ServedModel,
              reasoning: ReasoningSetup | None) -> ChatCompletionRequest:
    """The request with Ollama's ``think``: true (or a level, "low" / "medium" / "high")
    needs a model that thinks (its thinking is answered as ``thinking``), false turns the
    thinking off in the chat template of a model that has it."""
    if think is None:
        return req
    if not isinstance(think, bool) and think not in ("low", "medium", "high"):
        raise bad_request("think must be true, false, \"low\", \"medium\" or \"high\"",
                          "think")
    parser = resolve_reasoning_parser((reasoning or ReasoningSetup()).parser,
                                      served.tokenizer.chat_template)
    if parser is None:
        if think is False:
            return req
        raise bad_request("think: this model does not think (it has no reasoning parser)",
                          "think")
    if think is False:
        kwargs = {**(req.chat_template_kwargs or {}), "enable_thinking": False}
        return req.model_copy(update={"chat_template_kwargs": kwargs})
    return req


def _continued(req: ChatCompletionRequest | CompletionRequest, context: list[int],
               served: ServedModel) -> CompletionRequest:
    """The request as token ids: ``context``, then its prompt (templated unless raw)."""
    tokenizer = served.tokenizer
    if isinstance(req, CompletionRequest):
        assert isinstance(req.prompt, str)
        limit = served.max_model_len * MAX_CHARS_PER_TOKEN
        if len(req.prompt) > limit:
            raise bad_request(f"prompt is longer than {limit} characters", "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=False)
    else:
        # The turn as the template renders it, as Ollama appends it to the context (a BOS
        # the template writes stays: on SmolLM it is the turn's own <|im_start|>).
        ids = render_prompt(tokenizer, req, served.max_model_len)[1]
    fields = req.model_dump(exclude_unset=True, exclude={"messages", "prompt"})
    return _validated(CompletionRequest, {**fields, "prompt": [*context, *ids],
                                          "max_tokens": req.max_tokens})


def _prompt_ids(call: ChatCall | CompletionCall) -> list[list[int]]:
    if isinstance(call, CompletionCall):
        return [p.token_ids for p in call.prompts]
    return [p["prompt_token_ids"] for p in call.engine_prompts]  # type: ignore[index]


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
