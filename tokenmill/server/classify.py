"""POST /v1/classify: validate (in api/), score every label with the engine, answer whole."""

from __future__ import annotations

import functools

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.classify import ClassifyRequest, prepare_classify, score_labels
from tokenmill.api.protocol import now, random_id
from tokenmill.server.serving import submit
from tokenmill.server.state import ServerState
from tokenmill.server.streaming import until_disconnect


async def create_classification(state: ServerState, req: ClassifyRequest,
                                raw: Request) -> Response:
    """Validate, score and answer one classify request; the engine requests stop if the
    client goes away first."""
    served = await state.resolve(req.model)
    with served.lease():  # scoring submits as it goes
        call = await state.offload(prepare_classify, req, served.client)
        scoring = score_labels(call.scorer, functools.partial(submit, state, served),
                               served.client.capacity)
        results = await until_disconnect(raw.receive, scoring)
    if results is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    body = call.response(results, served.name, random_id(call.id_prefix), now())
    return JSONResponse(body.model_dump())
