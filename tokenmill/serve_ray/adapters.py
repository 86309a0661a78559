"""LoRA adapters loaded and unloaded while serving (``--allow-runtime-lora-updating``) under
``--replicas``: every replica of the base model's deployment serves the same adapters.

A Ray Serve handle reaches *a* replica, never each one, so the change is a log rather than a
broadcast. The ingress sends ``POST /v1/load_lora_adapter`` (or unload) to one replica of the
deployment, which answers it as ``tokenmill serve`` does (the folder is checked there); when
it succeeds the ingress appends the operation to the deployment's log (``AdapterLog``, a small
named actor) and from then on sends the log's position (``LogPosition``: which log, how long)
with every request. A replica that has applied fewer operations reads the rest of the log and
applies them, in order, before it answers: a request naming the new adapter never reaches a replica without it, and a replica
that Ray starts later (a replacement, autoscaling) catches up the same way. Replicas apply
the same operations in the same order, so each adapter gets the same ``lora_int_id`` (hence
the same prefix-cache salt) on every replica. The log lives as long as the ingress that owns
it: an ingress Ray restarts starts a new one (a new name), which the replicas replay from its
start (an operation already in effect on a replica is skipped there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

import ray

from tokenmill.api.errors import APIError
from tokenmill.engine.args import LoRAModule
from tokenmill.serve_ray.messages import HTTPRequestData
from tokenmill.server.lifecycle import path_inside
from tokenmill.server.lora_adapters import load_adapter, unload_adapter
from tokenmill.server.state import ServerState, bearer_token

logger = logging.getLogger(__name__)

LOG_NAME = "tokenmill-adapter-log"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


@dataclass(frozen=True)
class AdapterOp:
    """One change: ``module`` loaded (its name, checked path and base), or the adapter
    ``name`` unloaded (``module`` None)."""

    name: str
    module: LoRAModule | None = None


@ray.remote(num_cpus=0)
class AdapterLog:
    """Each deployment's operations, in the order they succeeded."""

    def __init__(self) -> None:
        self._ops: dict[str, list[AdapterOp]] = {}

    def append(self, deployment: str, op: AdapterOp) -> int:
        """Add ``op``; the deployment's log length after it."""
        ops = self._ops.setdefault(deployment, [])
        ops.append(op)
        return len(ops)

    def since(self, deployment: str, start: int) -> list[AdapterOp]:
        """The deployment's operations from the ``start``-th on."""
        return self._ops.get(deployment, [])[start:]


@dataclass(frozen=True)
class LogPosition:
    """Where a deployment's adapter log stands: the log's actor name (one per ingress life)
    and how many operations it holds."""

    log: str = ""
    length: int = 0


class AdapterSync:
    """A replica's side: which log it follows and how much of it it has applied."""

    def __init__(self, state: ServerState, deployment: str) -> None:
        self.state = state
        self.deployment = deployment
        self.log = ""
        self.applied = 0

    def behind(self, at: LogPosition) -> bool:
        """Whether the replica must catch up before it answers a request sent at ``at``."""
        return at.log != self.log or at.length > self.applied

    async def catch_up(self, at: LogPosition) -> None:
        """Apply the log's operations up to ``at`` (the caller serializes calls)."""
        if at.log != self.log:  # a new ingress's log: replayed from its start
            self.log, self.applied = at.log, 0
        if at.length <= self.applied:
            return
        log = ray.get_actor(at.log)
        for op in await log.since.remote(self.deployment, self.applied):
            await self._apply(op)
            self.applied += 1

    async def _apply(self, op: AdapterOp) -> None:
        """One operation; those this replica made itself (it answered the request) and those
        that fail here (a folder missing on this node) are logged, not raised: a request for
        the adapter then gets this replica's 404."""
        try:
            if op.module is not None:
                if op.name not in self.state.adapters:
                    await load_adapter(self.state, op.module)
            elif op.name in self.state.adapters:
                await unload_adapter(self.state, op.name)
        except APIError as e:
            logger.warning("LoRA adapter %s %s on this replica failed: %s", op.name,
                           "loading" if op.module is not None else "unloading", e.message)


class AdapterRoutes:
    """The ingress's side: which deployment a load or unload goes to, who may send one, and
    the log's length of each deployment (sent with every request to it)."""

    def __init__(self, admin_key: str | None, api_key: str | None,
                 models_dir: str | None) -> None:
        self.admin_key = admin_key
        self.api_key = api_key
        self.models_dir = os.path.realpath(models_dir) if models_dir else None
        self._versions: dict[str, int] = {}
        # This ingress's own log (a restarted ingress starts another).
        self._log_name = f"{LOG_NAME}-{secrets.token_hex(6)}"
        self._log: ray.actor.ActorHandle | None = None
        # One change at a time: the log's order is the order the replicas answered.
        self.lock = asyncio.Lock()

    def position(self, deployment: str) -> LogPosition:
        """How much of ``deployment``'s log a request to it needs applied."""
        return LogPosition(self._log_name, self._versions.get(deployment, 0))

    def authorize(self, req: HTTPRequestData) -> HTTPRequestData | APIError:
        """With an admin key only it may change adapters, as on one server (401 otherwise);
        the replica, whose app has no admin key, then gets the server's API key instead.
        Without one the replica checks the API key itself."""
        if self.admin_key is None:
            return req
        given = bearer_token(_header(req, b"authorization"))
        if given is None or not hmac.compare_digest(given.encode(), self.admin_key.encode()):
            return APIError(401, "missing or invalid admin key (send Authorization: Bearer "
                            "<admin key>)", code="invalid_admin_key")
        headers = [(k, v) for k, v in req.headers if k.lower() != b"authorization"]
        if self.api_key is not None:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        return dataclasses.replace(req, headers=headers)

    @staticmethod
    def model_named(req: HTTPRequestData) -> str | None:
        """The name whose deployment answers: the base model of a load, the adapter of an
        unload (None: the default model's)."""
        body = _json(req.body)
        name = body.get("base_model_name" if req.path == LOAD_PATH else "lora_name")
        return name if isinstance(name, str) else None

    def operation(self, req: HTTPRequestData) -> AdapterOp:
        """The log's record of a load or unload a replica just answered with success."""
        body = _json(req.body)
        if req.path == UNLOAD_PATH:
            return AdapterOp(body["lora_name"])
        path = path_inside(self.models_dir, body["lora_path"], "lora_path")
        return AdapterOp(body["lora_name"], LoRAModule(body["lora_name"], path,
                                                       body.get("base_model_name")))

    async def record(self, deployment: str, op: AdapterOp) -> None:
        """Append ``op`` to ``deployment``'s log: later requests carry the new length."""
        if self._log is None:
            self._log = AdapterLog.options(name=self._log_name, get_if_exists=True).remote()
        self._versions[deployment] = await self._log.append.remote(deployment, op)


def _header(req: HTTPRequestData, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in req.headers if k.lower() == name), None)


def _json(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
