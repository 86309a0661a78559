"""LoRA adapters in the server, as vLLM serves them: ``--lora-modules`` at start, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` while serving (with
``--allow-runtime-lora-updating``).

An adapter is served under a name of its own: a request naming it runs on its base model's
engine with the adapter's weights, and its answer names the adapter. Adapters are kept in
``ServerState.adapters``, apart from the models, because they share their base's engine: what
starts, drains, counts or unloads engines walks the models alone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from tokenmill.api.errors import APIError, bad_request
from tokenmill.api.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tokenmill.config import EngineConfig
from tokenmill.engine.args import LoRAModule
from tokenmill.lora_request import LoRARequest
from tokenmill.server.errors import read_json
from tokenmill.server.lifecycle import DRAIN_POLL_S, path_inside
from tokenmill.server.state import GENERATE, ServedModel, ServerState


def check_lora_options(configs: Sequence[EngineConfig], modules: Sequence[LoRAModule],
                       allow_runtime_updating: bool) -> None:
    """Refuse, before any model loads, adapter options that no model could honour."""
    if any(c.lora.enable_lora for c in configs):
        return
    if modules:
        raise ValueError("--lora-modules needs --enable-lora (or enable-lora among the "
                         "options of a --model)")
    if allow_runtime_updating:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")


def _check_name_free(state: ServerState, name: str) -> None:
    if name in state.adapters:
        raise APIError(400, f"a LoRA adapter named {name!r} is already loaded", param="lora_name",
                       code="model_exists")
    if name in state.models:
        raise APIError(400, f"{name!r} is the name of a served model; an adapter needs a name "
                       "of its own", param="lora_name", code="model_exists")


def _base_of(state: ServerState, module: LoRAModule) -> ServedModel:
    """The model the adapter runs on: 404 for a name no model has, 400 for a model that does
    not generate text or was started without adapters."""
    if module.base_model_name is None:
        base = state.model(None, GENERATE)
    else:
        found = state.models.get(module.base_model_name)
        if found is None:
            raise APIError(404, f"base_model_name {module.base_model_name!r} is not a served "
                           f"model; the models are {', '.join(map(repr, state.models))}",
                           param="base_model_name", code="model_not_found")
        base = found
    if base.task != GENERATE:
        raise bad_request(f"the model {base.name!r} computes embeddings; adapters apply to "
                          "text generation", "base_model_name")
    if not base.client.engine.lora_enabled:
        raise bad_request(f"the model {base.name!r} runs no LoRA adapters: start the server "
                          "with --enable-lora", "base_model_name")
    return base


async def load_adapter(state: ServerState, module: LoRAModule) -> ServedModel:
    """Read and check the adapter against its base model (off the event loop) and serve it
    under its name, with a lora_int_id of its own; 400 naming the problem (the name is taken,
    the folder is not an adapter of that model), 404 for an unknown base."""
    _check_name_free(state, module.name)
    base = _base_of(state, module)
    lora = LoRARequest(module.name, next(state.lora_ids), module.path)
    try:
        await base.client.add_lora(lora)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    # While the adapter was read, the name may have been taken or the base unloaded.
    try:
        _check_name_free(state, module.name)
        if state.models.get(base.name) is not base:
            raise APIError(409, f"the model {base.name!r} was unloaded or swapped while the "
                           "adapter loaded", param="base_model_name", code="model_changed")
    except APIError:
        base.client.remove_lora(lora.lora_int_id)
        raise
    served = ServedModel(module.name, base.client, GENERATE, path=module.path, lora=lora,
                         base=base)
    state.adapters[module.name] = served
    return served


async def unload_adapter(state: ServerState, name: str) -> None:
    """Stop serving the adapter and have its engine forget it; requests already running with
    it finish with it. 404 for a name no adapter has, 400 for a base model's name."""
    served = state.adapters.pop(name, None)
    if served is None:
        if name in state.models:
            raise bad_request(f"{name!r} is a served model, not a LoRA adapter", "lora_name")
        raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                       code="model_not_found")
    # A request that resolved it but is not yet queued would read it back into the engine.
    while served.leases:
        await asyncio.sleep(DRAIN_POLL_S)
    assert served.lora is not None
    served.client.remove_lora(served.lora.lora_int_id)


def load_lora_modules(state: ServerState, modules: Sequence[LoRAModule]) -> None:
    """Serve the ``--lora-modules`` adapters, each checked now (before the port opens);
    ValueError naming the adapter and what is wrong with it."""

    async def load_all() -> None:
        for module in modules:
            try:
                await load_adapter(state, module)
            except APIError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None

    asyncio.run(load_all())


def lora_router(state: ServerState, auth: Callable[[Request], Awaitable[None]]) -> APIRouter:
    """The runtime adapter routes, behind ``auth``; without --allow-runtime-lora-updating
    they answer 403 saying so."""

    async def allowed(request: Request) -> None:
        await auth(request)
        if not state.config.allow_runtime_lora_updating:
            raise APIError(403, "loading LoRA adapters at runtime is off: start the server "
                           "with --enable-lora --allow-runtime-lora-updating",
                           code="lora_updating_disabled")

    router = APIRouter(prefix="/v1", dependencies=[Depends(allowed)])

    @router.post("/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        body = await read_json(state, request, LoadLoRAAdapterRequest)
        # With --models-dir, clients load adapters from inside it only, as models.
        models_dir = state.config.models_dir
        path = path_inside(None if models_dir is None else os.path.realpath(models_dir),
                           body.lora_path, "lora_path")
        served = await load_adapter(state, LoRAModule(body.lora_name, path,
                                                      body.base_model_name))
        assert served.base is not None
        return PlainTextResponse(f"Success: LoRA adapter {served.name!r} loaded on "
                                 f"{served.base.name!r}.")

    @router.post("/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        body = await read_json(state, request, UnloadLoRAAdapterRequest)
        await unload_adapter(state, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} unloaded.")

    return router
