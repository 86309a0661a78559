"""The Ray Serve application: a deployment of replicas (``ReplicaServer``) with the chosen
request router and its resources, and the ingress (``Ingress``) in front of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.serve_ray.ingress import Ingress
from tokenmill.serve_ray.replica import ReplicaServer
from tokenmill.serve_ray.routing import router_class

REPLICA_DEPLOYMENT = "tokenmill-replica"
INGRESS_DEPLOYMENT = "tokenmill-ingress"


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


def build_application(models: Sequence[tuple[str | None, EngineConfig]], server: ServerConfig,
                      scale: ScaleConfig) -> Application:
    """The replicas and the ingress, bound; ``serve.run`` starts them."""
    cls = router_class(scale.router)
    router = RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs={"imbalanced_threshold": scale.imbalanced_threshold}
        if scale.router == "prefix" else {}) if cls else None
    sizing: dict[str, object] = {"num_replicas": scale.replicas}
    if scale.replicas is None:
        sizing = {"autoscaling_config": {
            "min_replicas": scale.min_replicas, "max_replicas": scale.max_replicas,
            "initial_replicas": max(scale.min_replicas, 1),
            "target_ongoing_requests": scale.target_ongoing_requests}}
    options: dict[str, object] = {}
    if router is not None:
        options["request_router_config"] = router
    replicas = serve.deployment(
        ReplicaServer, name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": scale.replica_cpus, "num_gpus": scale.replica_gpus},
        max_ongoing_requests=scale.max_ongoing_requests,
        health_check_period_s=scale.health_check_period_s,
        graceful_shutdown_timeout_s=server.drain_timeout, **sizing, **options)
    # The ingress only forwards: no CPU of its own to reserve, and no limit of its own.
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(replicas.bind(list(models), server),
                        own_metrics=not server.auth_health_metrics)
