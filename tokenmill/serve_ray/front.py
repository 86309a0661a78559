"""What the ingress answers itself under ``--replicas``, and the projects' side of routing.

- With ``--admin-key``: the Administration API (``/v1/organization/...``: projects, keys,
  usage, costs, the audit log) over the one tenancy store, ``<data dir>/tenancy.sqlite`` on
  the ingress's machine, with the single server's routes (organization_routes.py). A project
  key is checked against the store, and its project's limits applied, before the request is
  routed (``TenancyGuard.admit``); the replica that answers it gets the caller and meters the
  request into the same store (``ReplicaTenancy``), its limits' windows being shared by every
  process over the file (tenancy/windows.py). Replicas on other machines cannot open the file:
  projects need their replicas on the ingress's machine (or a data folder they all share).
- Refused with a 400 naming the limitation: loading models through ``/admin/models`` (the
  deployments are fixed at start) and batches (they run on one server's engines). Files and
  vector stores are the ingress's (stores.py).
"""

from __future__ import annotations

import contextvars
from typing import Any

from fastapi import Depends, FastAPI

from tokenmill.api.errors import APIError
from tokenmill.config import ServerConfig
from tokenmill.retrieval.service import default_data_dir
from tokenmill.server.admin_routes import admin_key_check
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.launcher import load_models
from tokenmill.server.organization_routes import organization_router
from tokenmill.server.tenancy_guard import ADMIN_PREFIXES, TenancyGuard
from tokenmill.server.tenancy_objects import ObjectGuard
from tokenmill.tenancy.limits import Limiter
from tokenmill.tenancy.meter import Tab, current_tab
from tokenmill.tenancy.metrics import ProjectMetrics
from tokenmill.tenancy.retention import TenancySettings, UsagePruner
from tokenmill.tenancy.store import Caller, TenancyStore

UNSUPPORTED = "unsupported_with_replicas"
# Batches run on one server's engines, reading the files of its store.
BATCH_PREFIX = "/v1/batches"


def unsupported(path: str) -> APIError | None:
    """The refusal of a request ``--replicas`` does not serve (None: it is served)."""
    if path == BATCH_PREFIX or path.startswith(BATCH_PREFIX + "/"):
        return APIError(400, "batches (/v1/batches) are not served with --replicas: they run "
                        "on one server's engines; serve them from one `tokenmill serve` "
                        "without --replicas, or send the requests themselves", code=UNSUPPORTED)
    return None


def is_admin_path(path: str) -> bool:
    """Whether the ingress answers ``path`` itself (the admin routes)."""
    return path.startswith(ADMIN_PREFIXES)


class FrontDoor:
    """The ingress's tenancy: the admin routes' app, and project keys' admission."""

    def __init__(self, config: ServerConfig, settings: TenancySettings | None = None) -> None:
        settings = settings or TenancySettings()
        # No engines: the admin routes read only the server's options and worker threads.
        self.state = load_models([], config)
        self.store = TenancyStore(config.data_dir or default_data_dir())
        self.limiter = Limiter(self.store)
        pruner = UsagePruner(self.store, settings.usage_retention_days)
        pruner.prune_now()
        self.guard = TenancyGuard(None, self.store, self.limiter,  # type: ignore[arg-type]
                                  content=config.audit_log_content, pruner=pruner)
        self.app = self._admin_app()

    def _admin_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.state.tokenmill = self.state
        install_error_handlers(app)
        app.include_router(organization_router(self.state, self.store))

        @app.api_route("/admin/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"],
                       dependencies=[Depends(admin_key_check(self.state))])
        async def models_are_fixed(rest: str) -> None:
            raise APIError(400, "loading, swapping and unloading models through /admin is not "
                           "served with --replicas: each model is a deployment fixed at start "
                           "(restart with other --model options, or use --models-dir)",
                           code=UNSUPPORTED)

        return app

    def admit(self, token: str) -> tuple[Caller, dict[str, str]] | APIError:
        """A project key's caller and rate-limit headers (``release`` when its answer ends),
        or the 401 / 429 to answer."""
        return self.guard.admit(token)

    def release(self, caller: Caller) -> None:
        """The request of ``caller`` admitted by ``admit`` ended."""
        self.limiter.release(caller.project.id)
        if self.guard.pruner is not None:
            self.guard.pruner.maybe_prune()

    def audit(self, kind: str, details: dict[str, Any]) -> None:
        """Record an action of the admin key (a LoRA adapter loaded through the ingress)."""
        self.store.audit(kind, None, "admin_key", details)


class ReplicaTenancy:
    """A replica's side: the requests the ingress admitted for a project, metered into the
    shared store as one server meters them, and the projects' objects kept apart."""

    def __init__(self, config: ServerConfig, registry: Any) -> None:
        self.store = TenancyStore(config.data_dir or default_data_dir())
        self.limiter = Limiter(self.store)
        self.metrics = ProjectMetrics(registry)
        self.content = config.audit_log_content
        self.server_key = config.api_key is not None

    def wrap(self, app: Any) -> Any:
        """``app`` behind the object guard (a project sees its own stored responses)."""
        return ObjectGuard(app, store=self.store, server_key=self.server_key)

    def context(self, caller: Caller | None) -> contextvars.Context:
        """A context in which the request runs as ``caller``'s (no project: as it is)."""
        context = contextvars.copy_context()
        if caller is not None:
            self.limiter.follow(caller.project)
            tab = Tab(caller, self.store, self.limiter, self.metrics, self.content)
            context.run(current_tab.set, tab)
        return context
