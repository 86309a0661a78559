"""OpenAI's Batch API (``/v1/batches``): create a batch over an uploaded JSONL file (purpose
``batch``), retrieve, list and cancel it; its output and error files are files of the same
caller. Each line is sent to the server itself, in process, as the batch's creator (its
project key's scope, priority class and usage accounting, or the server key), so a line gets
the answer the endpoint would give. The runs are tokenmill/retrieval/batches.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from tokenmill.api.errors import bad_request, parse_json
from tokenmill.api.files import list_query
from tokenmill.retrieval.batches import (
    BatchCreate,
    BatchRun,
    BatchStore,
    Call,
    StoreFile,
    new_batch,
)
from tokenmill.retrieval.service import RetrievalService
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.state import ServerState
from tokenmill.tenancy.meter import Tab, current_tab

MAX_LIMIT, DEFAULT_LIMIT = 100, 20


def _caller(app: ASGIApp, state: ServerState, tab: Tab | None) -> Call:
    """Send one line's body to the server's own endpoint, as the batch's creator."""
    headers = {"content-type": "application/json"}
    if tab is None and state.config.api_key is not None:
        headers["authorization"] = f"Bearer {state.config.api_key}"

    async def call(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if tab is not None:  # each line's latency from its own start
            current_tab.set(dataclasses.replace(tab, started=time.monotonic()))
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            r = await c.post(url, json=body, headers=headers, timeout=None)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text[:1000]}}

    return call


def _storer(service: RetrievalService, tab: Tab | None) -> StoreFile:
    """Keep a finished output as a ``batch_output`` file of the batch's creator."""
    async def store_file(path: str, name: str) -> str:
        upload = service.upload_path()
        await asyncio.to_thread(shutil.move, path, upload)
        file = await service.create_file(upload, name, "batch_output",
                                         os.path.getsize(upload))
        if tab is not None:
            tab.store.set_owner(file.id, tab.caller.project.id)
        return file.id

    return store_file


def batch_router(service: RetrievalService, state: ServerState) -> APIRouter:
    """The /v1/batches routes; batches kept in the files' data folder."""
    router = APIRouter()
    store = BatchStore(service.data_dir)
    runs: dict[str, BatchRun] = {}
    tasks: set[asyncio.Task[None]] = set()

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        check_json_content_type(request)
        raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        req = (await state.offload(parse_json, raw, BatchCreate)).checked()
        file = await service.get_file(req.input_file_id)
        if file.purpose != "batch":
            raise bad_request(f"the input file's purpose must be 'batch', got "
                              f"{file.purpose!r}", "input_file_id")
        path, _ = await service.file_path(req.input_file_id)
        batch = new_batch(req)
        store.save(batch)
        tab = current_tab.get()
        run = runs[batch["id"]] = BatchRun(store, batch, _caller(request.app, state, tab),
                                           _storer(service, tab))
        task = asyncio.create_task(run.run(path))
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), runs.pop(batch["id"], None)))
        return JSONResponse(batch)

    @router.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        p = request.query_params
        q = list_query(p.get("limit"), p.get("order"), p.get("after"), p.get("before"),
                       max_limit=MAX_LIMIT, default_limit=DEFAULT_LIMIT)
        return JSONResponse(await asyncio.to_thread(store.page, q))

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(store.get(batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> JSONResponse:
        batch = store.get(batch_id)
        run = runs.get(batch_id)
        return JSONResponse(run.cancel() if run is not None else batch)

    return router
