"""Ollama's API on the same server, for the `ollama` client library, Open WebUI and the other
tools that speak it: /api/version, /api/tags, /api/ps, /api/show, /api/chat and /api/generate
(NDJSON streams unless ``"stream": false``), /api/embed and /api/embeddings. Requests become
the OpenAI ones of tokenmill/api/ollama.py and run through the same validation (bodies: JSON
declared as such, strict, nested at most 64 levels), engine and disconnect handling; errors
are Ollama's ``{"error": "..."}`` (server/errors.py answers every error under /api/ so)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api import ollama
from tokenmill.api.chat import ChatCall
from tokenmill.api.completions import CompletionCall
from tokenmill.api.embeddings import prepare_embeddings
from tokenmill.api.errors import APIError, bad_request, loads_json
from tokenmill.api.protocol import ChatCompletionRequest, CompletionRequest, random_id
from tokenmill.api.response_building import StreamUsage, engine_error
from tokenmill.engine.async_llm import EngineDeadError, RequestGroup, collect_embeddings
from tokenmill.engine.model_files import model_files
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.serving import reasoning_setup, submit
from tokenmill.server.state import EMBED, GENERATE, ServedModel, ServerState
from tokenmill.server.streaming import EngineStreamingResponse, until_disconnect

# The weight files of a model folder, whose sizes make the model's size: the first kind of
# these it has (a folder may hold the same weights as .safetensors and as .bin).
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


async def _body(state: ServerState, request: Request) -> Any:
    """The JSON body, parsed as strictly as the /v1 routes' (any JSON value: the mapping
    checks its shape): 415 unless declared JSON, 413/408 for too large or too slow, 400 for
    invalid UTF-8, invalid JSON, NaN / Infinity, or nesting past 64 levels."""
    check_json_content_type(request)
    raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
    return await state.offload(_parse, raw)


def _parse(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return loads_json(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad_request(f"the body is not valid UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None


async def _resolve(state: ServerState, name: Any, task: str | None) -> ServedModel:
    """The served model an Ollama name means (``name:latest`` is ``name``)."""
    if not isinstance(name, str) or not name:
        raise APIError(400, "model is required", param="model")
    if not state.serves(name) and name.endswith(":latest"):
        name = name.removesuffix(":latest")
    return await state.resolve(name, task)


def _details(served: ServedModel) -> dict[str, Any]:
    info = served.client.engine.model_info()
    params = info.num_parameters
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    # Ollama names families as llama.cpp does: "llama", "qwen2", "bert".
    family = info.architecture
    for suffix in ("ForCausalLM", "ForMaskedLM", "Model"):
        family = family.removesuffix(suffix)
    family = family.lower()
    return {"parent_model": served.base.name if served.base is not None else "",
            "format": "gguf" if info.path.endswith(".gguf") else "safetensors",
            "family": family, "families": [family],
            "parameter_size": size, "quantization_level": info.quantization}


def _modelfile(served: ServedModel) -> str:
    """What Ollama's Modelfile would say: the weights, and an adapter's base, by file or
    folder name (where they lie on the server is not the client's business)."""
    if served.base is None:
        return f"FROM {_file_name(served.path)}\n"
    return f"FROM {_file_name(served.base.path)}\nADAPTER {_file_name(served.path)}\n"


def _file_name(path: str) -> str:
    return os.path.basename(path.rstrip("/" + os.sep))


def _file_size(path: str) -> int:
    """Bytes of the model on disk, as Ollama's size is its file's: the file, or a folder's
    weight files (0 when none can be read)."""
    try:
        if os.path.isfile(path):
            return sum(os.path.getsize(p) for p in model_files(path))
        with os.scandir(path) as entries:
            files = [(e.name, e.stat().st_size) for e in entries if e.is_file()]
    except OSError:
        return 0
    for suffix in WEIGHT_SUFFIXES:
        sizes = [size for name, size in files if name.endswith(suffix)]
        if sizes:
            return sum(sizes)
    return 0


def _entry(served: ServedModel) -> dict[str, Any]:
    """One model in /api/tags (``size``: its file's bytes, as Ollama's)."""
    return {"name": served.name, "model": served.name,
            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(served.loaded_at)),
            "size": _file_size(served.path),
            # A stable id of the model file (Ollama's is its blob's sha256).
            "digest": hashlib.sha256(served.path.encode()).hexdigest(),
            "details": _details(served)}


async def _lines(group: RequestGroup, call: Any, model: str, key: str) -> AsyncIterator[dict]:
    """Ollama's stream objects of one generation: the text as it comes, then the stats (and
    for /api/generate the ``context``: prompt and answer token ids)."""
    chunks = call.chunks(model, random_id(call.id_prefix), int(time.time()))
    usage, last, finish, answer = StreamUsage(), None, None, []
    try:
        async for index, out in group:
            usage.add(index, out)
            last = out
            answer += out.outputs[0].token_ids if out.outputs else []
            delta = chunks.delta(index, out)
            if delta is None or not delta.choices:
                continue
            choice = delta.choices[0]
            finish = choice.finish_reason or finish
            # A chat chunk's choice has a delta; a raw completion's, text.
            delta_msg = getattr(choice, "delta", None)
            text = (delta_msg.content if delta_msg is not None else choice.text) or ""
            calls = delta_msg.tool_calls if delta_msg is not None else None
            # A reasoning model's thinking: Ollama's ``thinking`` field.
            thinking = {"thinking": delta_msg.reasoning_content} \
                if delta_msg is not None and delta_msg.reasoning_content else {}
            if key == "message":
                message: dict[str, Any] = {"role": "assistant", "content": text, **thinking}
                if calls:
                    message["tool_calls"] = [{"function": {"name": c.function.name,
                                                           "arguments": _args(c)}}
                                             for c in calls if c.function is not None]
                if text or calls or thinking:
                    yield {"model": model, "created_at": ollama.now_iso(), "message": message,
                           "done": False}
            elif text or thinking:
                yield {"model": model, "created_at": ollama.now_iso(), "response": text,
                       **thinking, "done": False}
    except EngineDeadError as e:
        yield ollama.ollama_error(engine_error(e))
        return
    info = usage.info()
    end = {"role": "assistant", "content": ""} if key == "message" else ""
    context = ({"context": [*last.prompt_token_ids, *answer]}
               if key == "response" and last is not None else {})
    yield {"model": model, "created_at": ollama.now_iso(), key: end, "done": True,
           "done_reason": "length" if finish == "length" else "stop",
           **ollama.final_stats(last.metrics if last else None, info.prompt_tokens,
                                info.completion_tokens), **context}


def _args(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return call.function.arguments


async def _start(state: ServerState, served: ServedModel,
                 req: ChatCompletionRequest | CompletionRequest, body: dict[str, Any],
                 context: list[int] | None) -> tuple[ChatCall | CompletionCall, RequestGroup]:
    """serving.start_generation with Ollama's ways (api/ollama.prepare_ollama): validate off
    the event loop and queue in ``served``'s engine, holding the model meanwhile."""
    prepare = functools.partial(ollama.prepare_ollama, context=context,
                                split_special_tokens=state.config.split_special_tokens,
                                tool_call_parser=state.config.tool_call_parser,
                                reasoning=reasoning_setup(state))
    with served.lease():
        call = await state.offload(prepare, req, body, served.client)
        group = await submit(state, served, call.engine_prompts, call.params, call.id_prefix)
    return call, group


async def _generate(state: ServerState, request: Request, body: Any,
                    req: ChatCompletionRequest | CompletionRequest, key: str,
                    context: list[int] | None = None) -> Response:
    """Run a chat or generate request and answer as NDJSON lines or one object."""
    served = await _resolve(state, req.model, GENERATE)
    call, group = await _start(state, served, req, body, context)
    lines = _lines(group, call, served.name, key)
    if body.get("stream", True):
        async def ndjson() -> AsyncIterator[str]:
            async for line in lines:
                yield json.dumps(line, ensure_ascii=False) + "\n"

        return EngineStreamingResponse(ndjson(), group.close, media_type="application/x-ndjson")

    async def whole() -> dict[str, Any]:
        parts, calls, thoughts, final = [], [], [], {}
        try:
            async for line in lines:
                if "error" in line:
                    return line
                piece = line[key]
                parts.append(piece["content"] if key == "message" else piece)
                if key == "message":
                    calls += piece.get("tool_calls", [])
                    thoughts.append(piece.get("thinking", ""))
                else:
                    thoughts.append(line.get("thinking", ""))
                final = line
        finally:
            group.close()
        text, thinking = "".join(parts), "".join(thoughts)
        final[key] = ({"role": "assistant", "content": text, **({"tool_calls": calls}
                                                                  if calls else {}),
                       **({"thinking": thinking} if thinking else {})}
                      if key == "message" else text)
        if key == "response" and thinking:
            final["thinking"] = thinking
        return final

    result = await until_disconnect(request.receive, whole())
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result, status_code=500 if "error" in result else 200)


async def _embed(state: ServerState, request: Request, body: Any, legacy: bool) -> Response:
    req = ollama.embed_request(body, legacy)
    served = await _resolve(state, req.model, EMBED)
    started = time.monotonic()
    with served.lease():
        call = await state.offload(prepare_embeddings, req, served.client)
        group = await submit(state, served, call.prompts, call.params, call.id_prefix)

    async def run() -> Any:
        try:
            return await collect_embeddings(group)
        except EngineDeadError as e:
            raise engine_error(e) from None
        finally:
            group.close()

    outputs = await until_disconnect(request.receive, run())
    if outputs is None:
        return Response(status_code=499)
    answer = call.response(outputs, served.name)
    vectors = [d.embedding for d in answer.data]
    if legacy:
        return JSONResponse({"embedding": vectors[0]})
    return JSONResponse({"model": served.name, "embeddings": vectors,
                         "total_duration": int((time.monotonic() - started) * 1e9),
                         "load_duration": 0, "prompt_eval_count": answer.usage.prompt_tokens})


def ollama_router(state: ServerState) -> APIRouter:
    """The /api routes."""
    router = APIRouter(prefix="/api")

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ollama.OLLAMA_API_VERSION})

    def served() -> list[ServedModel]:
        """The models, then the LoRA adapters (each a model of its own here, as in Ollama)."""
        return [*state.models.values(), *state.adapters.values()]

    @router.get("/tags")
    async def tags() -> JSONResponse:
        return JSONResponse({"models": [_entry(m) for m in served()]})

    @router.get("/ps")
    async def ps() -> JSONResponse:
        # Ollama's running models report the memory they hold: weights and KV cache.
        return JSONResponse({"models": [{**_entry(m), "expires_at": "0001-01-01T00:00:00Z",
                                         "size": m.weight_bytes + m.kv_cache_bytes,
                                         "size_vram": 0} for m in served()]})

    @router.post("/show")
    async def show(request: Request) -> Response:
        body = await _body(state, request)
        served = await _resolve(state, body.get("model") if isinstance(body, dict) else None,
                                None)
        info = served.client.engine.model_info()
        template = served.client.tokenizer.chat_template or ""
        return JSONResponse({
            "modelfile": _modelfile(served), "parameters": "", "template": template,
            "details": _details(served),
            "model_info": {"general.architecture": info.architecture,
                           "general.parameter_count": info.num_parameters,
                           "context_length": info.max_model_len,
                           "embedding_length": info.num_attention_heads * info.head_dim},
            "capabilities": ["embedding"] if served.task == EMBED else ["completion", "tools"],
            "modified_at": _entry(served)["modified_at"], "size": _file_size(served.path)})

    @router.post("/chat")
    async def chat(request: Request) -> Response:
        body = await _body(state, request)
        return await _generate(state, request, body, ollama.chat_request(body), "message")

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        body = await _body(state, request)
        req = ollama.generate_request(body)
        return await _generate(state, request, body, req, "response", ollama.context_ids(body))

    @router.post("/embed")
    async def embed(request: Request) -> Response:
        return await _embed(state, request, await _body(state, request), legacy=False)

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _embed(state, request, await _body(state, request), legacy=True)

    return router

