"""OpenAI's Administration API for projects and their keys (``/v1/organization/...``), behind
the admin key: create, list, retrieve, modify (name, priority class, limits) and archive
projects; create, list, retrieve and revoke a project's API keys; read the audit log."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tokenmill.api.errors import APIError, parse_json
from tokenmill.api.organization import (
    ApiKeyBody,
    ProjectBody,
    api_key_object,
    deleted_key_object,
    list_page,
    project_object,
)
from tokenmill.api.organization_usage import (
    COST_GROUPS,
    CSV_COLUMNS,
    UsageQuery,
    audit_event,
    costs_page,
    usage_page,
    usage_query,
)
from tokenmill.retrieval.service import default_data_dir
from tokenmill.server.admin_routes import admin_key_check
from tokenmill.server.errors import check_json_content_type, read_body
from tokenmill.server.state import ServerState
from tokenmill.server.tenancy_audit import AdminAudit
from tokenmill.server.tenancy_guard import TenancyGuard
from tokenmill.server.tenancy_objects import ObjectGuard
from tokenmill.tenancy.limits import Limiter
from tokenmill.tenancy.metrics import ProjectMetrics
from tokenmill.tenancy.retention import TenancySettings, UsagePruner
from tokenmill.tenancy.store import NotFound, TenancyStore

# Who the audit log names for what the admin key does.
ADMIN_ACTOR = "admin_key"


def _not_found(what: str, ident: str, param: str) -> APIError:
    return APIError(404, f"no {what} with id {ident!r}", param=param, code="not_found")


def organization_router(state: ServerState, store: TenancyStore) -> APIRouter:
    """The /v1/organization routes, behind the admin key."""
    router = APIRouter(prefix="/v1/organization",
                       dependencies=[Depends(admin_key_check(state))])

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        check_json_content_type(request)
        raw = await read_body(request, state.config.max_body_bytes, state.config.body_timeout)
        return await state.offload(parse_json, raw, model)

    def project_or_404(project_id: str) -> Any:
        try:
            return store.project(project_id)
        except NotFound:
            raise _not_found("project", project_id, "project_id") from None

    @router.get("/projects")
    async def list_projects(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                            include_archived: bool = False) -> JSONResponse:
        items = [project_object(p) for p in store.projects(include_archived)]
        return JSONResponse(list_page(items, limit, after))

    @router.post("/projects")
    async def create_project(request: Request) -> JSONResponse:
        body: ProjectBody = await body_of(request, ProjectBody)
        if body.name is None:
            raise APIError(400, "name is required", param="name", code="missing_required_parameter")
        project = store.create_project(body.name, ADMIN_ACTOR, body.priority or 0, body.limits())
        return JSONResponse(project_object(project))

    @router.get("/projects/{project_id}")
    async def retrieve_project(project_id: str) -> JSONResponse:
        return JSONResponse(project_object(project_or_404(project_id)))

    @router.post("/projects/{project_id}")
    async def modify_project(project_id: str, request: Request) -> JSONResponse:
        project_or_404(project_id)
        body: ProjectBody = await body_of(request, ProjectBody)
        try:
            project = store.update_project(project_id, ADMIN_ACTOR, body.changes())
        except ValueError as e:
            raise APIError(400, str(e), param="project_id") from None
        return JSONResponse(project_object(project))

    @router.post("/projects/{project_id}/archive")
    async def archive_project(project_id: str) -> JSONResponse:
        project_or_404(project_id)
        return JSONResponse(project_object(store.archive_project(project_id, ADMIN_ACTOR)))

    @router.get("/projects/{project_id}/api_keys")
    async def list_keys(project_id: str, limit: int = Query(20, ge=1, le=100),
                        after: str | None = None) -> JSONResponse:
        project_or_404(project_id)
        items = [api_key_object(k) for k in store.keys(project_id)]
        return JSONResponse(list_page(items, limit, after))

    @router.post("/projects/{project_id}/api_keys")
    async def create_key(project_id: str, request: Request) -> JSONResponse:
        project_or_404(project_id)
        body: ApiKeyBody = await body_of(request, ApiKeyBody)
        try:
            key, value = store.create_key(project_id, body.name, ADMIN_ACTOR)
        except ValueError as e:
            raise APIError(400, str(e), param="project_id") from None
        return JSONResponse(api_key_object(key, value))

    @router.get("/projects/{project_id}/api_keys/{key_id}")
    async def retrieve_key(project_id: str, key_id: str) -> JSONResponse:
        project_or_404(project_id)
        try:
            return JSONResponse(api_key_object(store.key(project_id, key_id)))
        except NotFound:
            raise _not_found("API key", key_id, "key_id") from None

    @router.delete("/projects/{project_id}/api_keys/{key_id}")
    async def delete_key(project_id: str, key_id: str) -> JSONResponse:
        project_or_404(project_id)
        try:
            store.revoke_key(project_id, key_id, ADMIN_ACTOR)
        except NotFound:
            raise _not_found("API key", key_id, "key_id") from None
        return JSONResponse(deleted_key_object(key_id))

    _usage_routes(router, store)
    return router


def _params(request: Request) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in request.query_params.multi_items():
        out.setdefault(k, []).append(v)
    return out


def _usage_routes(router: APIRouter, store: TenancyStore) -> None:
    """Usage, costs and the audit log: OpenAI's pages, and exports (CSV, JSONL)."""

    def rows_of(q: UsageQuery) -> list[dict[str, Any]]:
        return store.usage_rows(q.start, q.end)

    @router.get("/usage/completions")
    async def usage_completions(request: Request) -> JSONResponse:
        q = usage_query(_params(request))
        return JSONResponse(usage_page(rows_of(q), q, "completions"))

    @router.get("/usage/embeddings")
    async def usage_embeddings(request: Request) -> JSONResponse:
        q = usage_query(_params(request))
        return JSONResponse(usage_page(rows_of(q), q, "embeddings"))

    @router.get("/costs")
    async def costs(request: Request) -> JSONResponse:
        q = usage_query(_params(request), COST_GROUPS)
        return JSONResponse(costs_page(rows_of(q), q))

    @router.get("/usage/export")
    async def usage_export(request: Request, format: str = "csv") -> Response:
        q = usage_query(_params(request))
        rows = [r for r in rows_of(q) if not q.project_ids or r["project_id"] in q.project_ids]
        if format == "jsonl":
            return Response("".join(json.dumps({c: r[c] for c in CSV_COLUMNS}) + "\n"
                                    for r in rows), media_type="application/x-ndjson")
        if format != "csv":
            raise APIError(400, f"format must be csv or jsonl, got {format!r}",
                           param="format", code="invalid_value")
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(CSV_COLUMNS)
        writer.writerows([r[c] for c in CSV_COLUMNS] for r in rows)
        return Response(out.getvalue(), media_type="text/csv", headers={
            "Content-Disposition": 'attachment; filename="tokenmill-usage.csv"'})

    @router.get("/audit_logs")
    async def audit_logs(request: Request, limit: int = Query(20, ge=1, le=100),
                         after: str | None = None) -> JSONResponse:
        params = _params(request)
        rows = store.audit_rows(before_id=_cursor(after), limit=limit + 1,
                                **_audit_filters(params))
        names = {p.id: p.name for p in store.projects(include_archived=True)}
        data = [audit_event(r, names) for r in rows[:limit]]
        return JSONResponse({"object": "list", "data": data,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None,
                             "has_more": len(rows) > limit})

    @router.get("/audit_logs/export")
    async def audit_export(request: Request) -> Response:
        rows = store.audit_rows(limit=-1, **_audit_filters(_params(request)))
        names = {p.id: p.name for p in store.projects(include_archived=True)}
        return Response("".join(json.dumps(audit_event(r, names)) + "\n"
                                for r in reversed(rows)), media_type="application/x-ndjson")


def _cursor(after: str | None) -> int | None:
    if after is None:
        return None
    try:
        return int(after.removeprefix("audit_log-"))
    except ValueError:
        raise APIError(400, f"after must be an audit log id, got {after!r}", param="after",
                       code="invalid_value") from None


def _audit_filters(params: dict[str, list[str]]) -> dict[str, Any]:
    """OpenAI's audit-log filters: event_types[], project_ids[], effective_at[gt|gte|lt|lte]."""
    def many(name: str) -> tuple[str, ...]:
        return tuple(v for value in params.get(name, []) + params.get(f"{name}[]", [])
                     for v in value.split(",") if v)

    def bound(op: str) -> float | None:
        values = params.get(f"effective_at[{op}]")
        if not values:
            return None
        try:
            return float(int(values[-1]))
        except ValueError:
            raise APIError(400, f"effective_at[{op}] must be Unix seconds", code="invalid_value",
                           param=f"effective_at[{op}]") from None

    gt, gte, lt, lte = bound("gt"), bound("gte"), bound("lt"), bound("lte")
    since = max(gte if gte is not None else 0, gt + 1 if gt is not None else 0)
    until = min(lt if lt is not None else float("inf"), lte + 1 if lte is not None else float("inf"))
    return {"types": many("event_types"), "project_ids": many("project_ids"),
            "since": since, "until": until}


def install_tenancy(app: FastAPI, state: ServerState,
                    settings: TenancySettings | None = None) -> TenancyStore | None:
    """With an admin key: the projects store (``<data dir>/tenancy.sqlite``), pruned to the
    usage retention now and then, its routes and the guard that resolves project keys. Call
    it before the outer middlewares are added."""
    if state.config.admin_key is None:
        return None
    settings = settings or TenancySettings()
    store = TenancyStore(state.config.data_dir or default_data_dir())
    pruner = UsagePruner(store, settings.usage_retention_days)
    pruner.prune_now()
    app.include_router(organization_router(state, store))
    # The object guard runs inside the tenancy guard: it reads the caller that one finds.
    app.add_middleware(ObjectGuard, store=store, server_key=state.config.api_key is not None)
    app.add_middleware(AdminAudit, store=store)
    app.add_middleware(TenancyGuard, store=store, limiter=Limiter(store),
                       metrics=ProjectMetrics(state.metrics.registry),
                       content=state.config.audit_log_content, pruner=pruner)
    return store
