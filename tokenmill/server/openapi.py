"""The server's OpenAPI document (``GET /openapi.json``): the routes read their bodies by hand
(size limit, strict JSON, errors in OpenAI's shape), so FastAPI cannot see their schemas; this
adds each route's request body from the API's pydantic models, for clients, code generators and
the schema fuzzer (benchmarks/fuzz_api.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]], version: str) -> None:
    """Serve an OpenAPI document whose components hold ``models`` (and what they refer to)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template=_REF)
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
