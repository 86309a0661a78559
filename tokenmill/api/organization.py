"""OpenAI's Administration API shapes for projects and their API keys: request bodies (with
tokenmill's limits and priority class beside the name) and the objects the routes answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# The limits a project may set (None: no limit), named as OpenAI's rate limits are.
LIMIT_FIELDS = ("max_requests_per_1_minute", "max_tokens_per_1_minute",
                "max_concurrent_requests", "monthly_budget")
# Limits beyond these are typing accidents, not plans: 400 rather than a silent "no limit".
MAX_RPM = 10_000_000
MAX_TPM = 10_000_000_000
MAX_CONCURRENT = 100_000
MAX_BUDGET = 1e9
# Priority classes, lower first (vLLM's reading of `priority`).
MIN_PRIORITY, MAX_PRIORITY = -100, 100


class ProjectBody(BaseModel):
    """POST /v1/organization/projects and /v1/organization/projects/{id}: OpenAI's ``name``,
    and tokenmill's priority class and limits (null: none)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=256)
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    max_requests_per_1_minute: int | None = Field(default=None, ge=1, le=MAX_RPM)
    max_tokens_per_1_minute: int | None = Field(default=None, ge=1, le=MAX_TPM)
    max_concurrent_requests: int | None = Field(default=None, ge=1, le=MAX_CONCURRENT)
    monthly_budget: float | None = Field(default=None, ge=0, le=MAX_BUDGET, allow_inf_nan=False)

    def limits(self) -> dict[str, Any]:
        """The limit fields the body sets (null included: it removes a limit)."""
        return {k: getattr(self, k) for k in LIMIT_FIELDS if k in self.model_fields_set}

    def changes(self) -> dict[str, Any]:
        """Every field the body sets; a null name or priority means no change."""
        out = self.limits()
        for name in ("name", "priority"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ApiKeyBody(BaseModel):
    """POST /v1/organization/projects/{id}/api_keys (tokenmill's: OpenAI makes keys in its
    dashboard only)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(default="", max_length=256)


def project_object(p: Any) -> dict[str, Any]:
    """OpenAI's ``organization.project`` of a tenancy Project, with its priority class and
    limits."""
    return {"id": p.id, "object": "organization.project", "name": p.name,
            "created_at": p.created_at, "archived_at": p.archived_at,
            "status": "active" if p.active else "archived", "priority": p.priority,
            **{k: getattr(p, k) for k in LIMIT_FIELDS}}


def api_key_object(k: Any, value: str | None = None) -> dict[str, Any]:
    """OpenAI's ``organization.project.api_key``; ``value`` only in the answer that made it."""
    out = {"object": "organization.project.api_key", "id": k.id, "name": k.name,
           "redacted_value": k.redacted_value, "created_at": k.created_at,
           "last_used_at": k.last_used_at,
           "owner": {"type": "service_account", "service_account": {"id": k.project_id}}}
    if value is not None:
        out["value"] = value
    return out


def deleted_key_object(key_id: str) -> dict[str, Any]:
    """OpenAI's answer to deleting a project API key."""
    return {"object": "organization.project.api_key.deleted", "id": key_id, "deleted": True}


def list_page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor list: ``limit`` items after the one whose id is ``after``."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
