"""OpenAI's usage, costs and audit-log shapes (Administration API), computed from plain rows:
the usage rows of finished requests (one per API call: time, project_id, key_id, model, kind,
input/output tokens, cost) and audit records. No storage and no HTTP here."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.api.errors import APIError

BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
# OpenAI's default and largest number of buckets per page, by width.
DEFAULT_LIMIT = {"1m": 60, "1h": 24, "1d": 7}
MAX_LIMIT = {"1m": 1440, "1h": 168, "1d": 31}
USAGE_GROUPS = ("project_id", "model", "api_key_id")
COST_GROUPS = ("project_id", "line_item")


@dataclass(frozen=True)
class UsageQuery:
    """The query of a usage or costs request, validated."""

    start: int
    end: int
    width: str
    limit: int
    group_by: tuple[str, ...] = ()
    project_ids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    api_key_ids: tuple[str, ...] = ()


def usage_query(params: dict[str, list[str]], groups: tuple[str, ...] = USAGE_GROUPS,
                default_width: str = "1d") -> UsageQuery:
    """A UsageQuery from query parameters (lists as ``name`` or ``name[]``, repeated or
    comma-separated); 400 naming the parameter for a bad one."""
    def many(name: str) -> tuple[str, ...]:
        values = params.get(name, []) + params.get(f"{name}[]", [])
        return tuple(v for value in values for v in value.split(",") if v)

    def one(name: str) -> str | None:
        values = params.get(name)
        return values[-1] if values else None

    start = _int(one("start_time"), "start_time", required=True)
    width = one("bucket_width") or default_width
    if width not in BUCKET_WIDTHS:
        raise APIError(400, f"bucket_width must be one of {', '.join(BUCKET_WIDTHS)}, got "
                       f"{width!r}", param="bucket_width", code="invalid_value")
    end = _int(one("end_time"), "end_time")
    end = int(time.time()) + 1 if end is None else end
    if end <= start:
        raise APIError(400, "end_time must be after start_time", param="end_time",
                       code="invalid_value")
    limit = _int(one("limit"), "limit")
    limit = DEFAULT_LIMIT[width] if limit is None else limit
    if not 1 <= limit <= MAX_LIMIT[width]:
        raise APIError(400, f"limit must be in [1, {MAX_LIMIT[width]}] for bucket_width "
                       f"{width}, got {limit}", param="limit", code="invalid_value")
    page = _int(one("page"), "page")
    group_by = many("group_by")
    bad = [g for g in group_by if g not in groups]
    if bad:
        raise APIError(400, f"group_by takes {', '.join(groups)}; got {bad[0]!r}",
                       param="group_by", code="invalid_value")
    return UsageQuery(start=max(start, page or start), end=end, width=width, limit=limit,
                      group_by=group_by, project_ids=many("project_ids"),
                      models=many("models"), api_key_ids=many("api_key_ids"))


def _int(value: str | None, name: str, required: bool = False) -> int | None:
    if value is None:
        if required:
            raise APIError(400, f"{name} is required (Unix seconds)", param=name,
                           code="missing_required_parameter")
        return None
    try:
        number = int(value)
    except ValueError:
        raise APIError(400, f"{name} must be an integer, got {value!r}", param=name,
                       code="invalid_value") from None
    if not 0 <= number < 1 << 40:
        raise APIError(400, f"{name} must be in [0, 2**40), got {number}", param=name,
                       code="invalid_value")
    return number


def _selected(rows: Iterable[dict[str, Any]], q: UsageQuery, kind: str | None
              ) -> list[dict[str, Any]]:
    return [r for r in rows
            if (kind is None or r["kind"] == kind)
            and (not q.project_ids or r["project_id"] in q.project_ids)
            and (not q.models or r["model"] in q.models)
            and (not q.api_key_ids or r["key_id"] in q.api_key_ids)]


def _buckets(q: UsageQuery) -> tuple[list[tuple[int, int]], str | None]:
    width = BUCKET_WIDTHS[q.width]
    count = math.ceil((q.end - q.start) / width)
    starts = [q.start + i * width for i in range(min(count, q.limit))]
    next_page = str(q.start + q.limit * width) if count > q.limit else None
    return [(s, min(s + width, q.end)) for s in starts], next_page


def usage_page(rows: list[dict[str, Any]], q: UsageQuery, kind: str) -> dict[str, Any]:
    """OpenAI's usage page for ``kind`` ("completions" or "embeddings")."""
    buckets, next_page = _buckets(q)
    rows = _selected(rows, q, kind)
    data = []
    for lo, hi in buckets:
        groups: dict[tuple, dict[str, Any]] = {}
        for r in rows:
            if not lo <= r["time"] < hi:
                continue
            key = tuple(r["key_id" if g == "api_key_id" else g] for g in q.group_by)
            g = groups.setdefault(key, {"input_tokens": 0, "output_tokens": 0,
                                        "num_model_requests": 0})
            g["input_tokens"] += r["input_tokens"]
            g["output_tokens"] += r["output_tokens"]
            g["num_model_requests"] += 1
        results = []
        for key, g in groups.items():
            named = dict(zip(q.group_by, key, strict=True))
            result: dict[str, Any] = {"object": f"organization.usage.{kind}.result",
                                      "input_tokens": g["input_tokens"]}
            if kind == "completions":
                result |= {"output_tokens": g["output_tokens"], "input_cached_tokens": 0,
                           "input_audio_tokens": 0, "output_audio_tokens": 0, "batch": None}
            result |= {"num_model_requests": g["num_model_requests"],
                       "project_id": named.get("project_id"), "user_id": None,
                       "api_key_id": named.get("api_key_id"), "model": named.get("model")}
            results.append(result)
        data.append({"object": "bucket", "start_time": lo, "end_time": hi,
                     "results": results})
    return {"object": "page", "data": data, "has_more": next_page is not None,
            "next_page": next_page}


def costs_page(rows: list[dict[str, Any]], q: UsageQuery, currency: str = "usd"
               ) -> dict[str, Any]:
    """OpenAI's costs page (line items: the kind of request and its model)."""
    buckets, next_page = _buckets(q)
    rows = _selected(rows, q, None)
    data = []
    for lo, hi in buckets:
        groups: dict[tuple, float] = {}
        for r in rows:
            if lo <= r["time"] < hi:
                key = tuple(r["project_id"] if g == "project_id"
                            else f"{r['kind']}, {r['model']}" for g in q.group_by)
                groups[key] = groups.get(key, 0.0) + r["cost"]
        results = [{"object": "organization.costs.result",
                    "amount": {"value": value, "currency": currency},
                    "line_item": dict(zip(q.group_by, key, strict=True)).get("line_item"),
                    "project_id": dict(zip(q.group_by, key, strict=True)).get("project_id")}
                   for key, value in groups.items()]
        data.append({"object": "bucket", "start_time": lo, "end_time": hi,
                     "results": results})
    return {"object": "page", "data": data, "has_more": next_page is not None,
            "next_page": next_page}


CSV_COLUMNS = ("time", "project_id", "key_id", "model", "kind", "input_tokens",
               "output_tokens", "cost", "finish_reason", "latency")


def audit_event(record: dict[str, Any], project_names: dict[str, str]) -> dict[str, Any]:
    """One audit record as OpenAI's ``organization.audit_log`` entry."""
    kind, pid = record["type"], record["project_id"]
    return {"object": "organization.audit_log", "id": f"audit_log-{record['id']}",
            "type": kind, "effective_at": record["time"],
            "project": {"id": pid, "name": project_names.get(pid)} if pid else None,
            "actor": {"type": "api_key", "api_key": {
                "id": record["actor"],
                "type": "admin" if record["actor"] == "admin_key" else "service_account"}},
            kind: {"id": record["details"].get("id", pid), "data": record["details"]}}
