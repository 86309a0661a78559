"""POST /v1/embeddings, /v1/score and /v1/rerank: validate and tokenize (in api/, off the event
loop), embed every input through the engine's scheduler, answer whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.embeddings import EmbeddingModel, PoolingCall, prepare_embeddings
from tokenmill.api.errors import APIError
from tokenmill.engine.async_llm import EngineDeadError, collect_embeddings
from tokenmill.outputs import EmbeddingRequestOutput
from tokenmill.server.serving import submit
from tokenmill.server.state import EMBED, ServerState
from tokenmill.server.streaming import until_disconnect


async def create_embeddings(state: ServerState, req: Any, raw: Request,
                            prepare: Callable[[Any, EmbeddingModel], PoolingCall]
                            = prepare_embeddings) -> Response:
    """Validate, embed and answer one embeddings request (or a score or rerank request, with
    its ``prepare``); the engine requests stop if the client goes away first."""
    served = await state.resolve(req.model, task=EMBED)
    with served.lease():
        call = await state.offload(prepare, req, served.client)
        group = await submit(state, served, call.prompts, call.params, call.id_prefix)

    async def run() -> list[EmbeddingRequestOutput]:
        try:
            return await collect_embeddings(group)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from None
        finally:
            group.close()

    outputs = await until_disconnect(raw.receive, run())
    if outputs is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    body = await state.offload(call.response, outputs, served.name)
    return JSONResponse(body.model_dump())
