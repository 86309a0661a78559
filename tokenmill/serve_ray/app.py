"""The Ray Serve application: one deployment of replicas (``ReplicaServer``) per served
model, each with the chosen request router (hence its own prefix table) and its resources,
and the ingress (``Ingress``) in front of them, which routes by the request's ``model``."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from tokenmill.api.validation import default_model_name
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.args import LoRAModule
from tokenmill.serve_ray.ingress import Ingress
from tokenmill.serve_ray.messages import INGRESS_DEPLOYMENT
from tokenmill.serve_ray.replica import ReplicaServer
from tokenmill.serve_ray.routing import router_class
from tokenmill.server.model_registry import ENCODER_MODEL_TYPES
from tokenmill.tenancy.retention import TenancySettings

REPLICA_DEPLOYMENT = "tokenmill-replica"
# The replicas that load models of --models-dir on demand.
ON_DEMAND_DEPLOYMENT = f"{REPLICA_DEPLOYMENT}-models-dir"


@dataclass(frozen=True)
class ScaleConfig:
    """How many replicas, what each takes, and how requests are routed to them."""

    # A fixed number of replicas; None: autoscaled between min_replicas and max_replicas.
    replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 1
    # Autoscaling's target: requests in flight or queued per replica.
    target_ongoing_requests: float = 4.0
    # Requests a replica takes at once; more wait in the ingress's queue.
    max_ongoing_requests: int = 64
    router: str = "prefix"
    # Load difference (requests) beyond which the prefix router balances instead.
    imbalanced_threshold: int = 4
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    health_check_period_s: float = 5.0

    def __post_init__(self) -> None:
        router_class(self.router)  # ValueError for an unknown one
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("min_replicas and max_replicas must satisfy 0 <= min_replicas <= "
                             f"max_replicas >= 1, got {self.min_replicas} and "
                             f"{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be positive, got "
                             f"{self.target_ongoing_requests}")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be at least 1, got "
                             f"{self.max_ongoing_requests}")


def deployment_name(index: int, name: str | None) -> str:
    """The deployment of the ``index``-th model (Ray's names: letters, digits, - _ .)."""
    if name:
        return f"{REPLICA_DEPLOYMENT}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
    return REPLICA_DEPLOYMENT if index == 0 else f"{REPLICA_DEPLOYMENT}-{index}"


def _router_config(scale: ScaleConfig) -> RequestRouterConfig | None:
    cls = router_class(scale.router)
    if cls is None:
        return None
    kwargs = {"imbalanced_threshold": scale.imbalanced_threshold} if scale.router == "prefix" \
        else {}
    # Routing stats carry each replica's KV-events endpoint: asked for soon after it starts.
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=1.0)


def generates(config: EngineConfig) -> bool:
    """Whether the model generates text (not task embed, not an encoder's folder)."""
    if config.model.task == "embed":
        return False
    try:
        with open(os.path.join(config.model.model or "", "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return True
    return model_type not in ENCODER_MODEL_TYPES


def assign_adapters(models: Sequence[tuple[str | None, EngineConfig]],
                    lora_modules: Sequence[LoRAModule],
                    served_model_name: str | None = None) -> list[list[LoRAModule]]:
    """Which model's deployment loads each adapter: the one its base_model_name names, or
    the first that generates text; ValueError for a base no model is known to have (a model
    without a name or path is named only once loaded: such bases are left to it)."""
    names = [name or served_model_name or (default_model_name(c.model.model)
                                            if c.model.model else None) for name, c in models]
    out: list[list[LoRAModule]] = [[] for _ in models]
    first = next((i for i, (_, c) in enumerate(models) if generates(c)), None)
    for module in lora_modules:
        if module.base_model_name is None:
            at = first
        elif module.base_model_name in names:
            at = names.index(module.base_model_name)
        else:
            unnamed = [i for i, (n, (_, c)) in enumerate(zip(names, models, strict=True))
                       if n is None and generates(c)]
            at = unnamed[0] if len(unnamed) == 1 else None
        if at is None:
            raise ValueError(f"--lora-modules {module.name}: base_model_name "
                             f"{module.base_model_name!r} is not a served model; the models "
                             f"are {', '.join(repr(n) for n in names if n)}")
        out[at].append(module)
    return out


def build_application(models: Sequence[tuple[str | None, EngineConfig]], server: ServerConfig,
                      scale: ScaleConfig, lora_modules: Sequence[LoRAModule] = (),
                      engine_args: argparse.Namespace | None = None,
                      tenancy: TenancySettings | None = None) -> Application:
    """A deployment per model (and with --models-dir one whose replicas load that folder's
    models on demand, with ``engine_args``: the command line's engine options) and the
    ingress, bound; ``serve.run`` starts them. ``tenancy``: the projects' options (with an
    admin key, whose routes the ingress answers)."""
    router = _router_config(scale)
    sizing: dict[str, object] = {"num_replicas": scale.replicas}
    if scale.replicas is None:
        sizing = {"autoscaling_config": {
            "min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas,
            "initial_replicas": max(scale.min_replicas, 1),
            "target_ongoing_requests": scale.target_ongoing_requests}}
    options: dict[str, object] = {
        "ray_actor_options": {"num_cpus": scale.replica_cpus, "num_gpus": scale.replica_gpus},
        "max_ongoing_requests": scale.max_ongoing_requests,
        "health_check_period_s": scale.health_check_period_s,
        "graceful_shutdown_timeout_s": server.drain_timeout, **sizing}
    if router is not None:
        options["request_router_config"] = router
    adapters = assign_adapters(models, lora_modules, server.served_model_name)
    deployments = [
        serve.deployment(ReplicaServer, name=deployment_name(i, model[0]), **options).bind(
            model, server, adapters[i], kv_events=scale.router == "prefix")
        for i, model in enumerate(models)]
    on_demand = None
    if server.models_dir is not None:
        if engine_args is None:
            raise ValueError("--models-dir needs the engine options of the models it loads")
        on_demand = serve.deployment(ReplicaServer, name=ON_DEMAND_DEPLOYMENT, **options).bind(
            None, server, engine_args=engine_args)
    # The ingress only forwards: no CPU of its own to reserve, and no limit of its own.
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(deployments, own_metrics=not server.auth_health_metrics,
                        on_demand=on_demand, models_dir=server.models_dir, server=server,
                        tenancy=tenancy)
