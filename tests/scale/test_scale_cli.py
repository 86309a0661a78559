"""`tokenmill serve`'s Ray Serve options: parsing, their contradictions, and the deployments
they build (fixed or autoscaled replicas, resources, router), without starting Ray."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ray.serve")

from tokenmill.config import EngineConfig, ServerConfig  # noqa: E402
from tokenmill.serve_ray.app import ScaleConfig, build_application  # noqa: E402
from tokenmill.serve_ray.cli import (  # noqa: E402
    add_ray_serve_args,
    scale_config_from_args,
    wants_ray,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_ray_serve_args(p)
    return p.parse_args(list(argv))


def _replicas(app):  # the replica deployment the ingress is bound to
    return app._bound_deployment.init_args[0]._bound_deployment


def test_no_replica_option_is_one_plain_server() -> None:
    assert not wants_ray(_args())
    assert wants_ray(_args("--replicas", "2"))
    assert wants_ray(_args("--max-replicas", "3"))


def test_fixed_replicas_with_resources_and_router() -> None:
    scale = scale_config_from_args(_args("--replicas", "3", "--router", "round_robin",
                                         "--replica-cpus", "2", "--replica-gpus", "1"))
    deployment = _replicas(build_application([(None, EngineConfig())], ServerConfig(), scale))
    assert deployment.num_replicas == 3
    assert deployment.ray_actor_options["num_cpus"] == 2
    assert deployment.ray_actor_options["num_gpus"] == 1
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("RoundRobinRouter")


def test_autoscaling_on_queue_length() -> None:
    scale = scale_config_from_args(_args("--min-replicas", "1", "--max-replicas", "4",
                                         "--target-ongoing-requests", "2"))
    assert scale.replicas is None
    deployment = _replicas(build_application([(None, EngineConfig())], ServerConfig(), scale))
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 2


@pytest.mark.parametrize("argv, message", [
    (("--replicas", "2", "--max-replicas", "3"), "not both"),
    (("--replicas", "0"), "replicas must be at least 1"),
    (("--min-replicas", "3", "--max-replicas", "2"), "min_replicas"),
    (("--max-replicas", "2", "--target-ongoing-requests", "0"), "target_ongoing_requests"),
])
def test_contradictions_name_the_option(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scale_config_from_args(_args(*argv))


def test_unknown_router_is_refused() -> None:
    with pytest.raises(ValueError, match="router"):
        ScaleConfig(router="random")


def test_serve_command_refuses_a_contradiction_before_starting_ray() -> None:
    """`tokenmill serve --replicas` goes to Ray Serve; a contradiction is a usage error that
    names the options, before any cluster or model starts."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--replicas", "2",
                           "--max-replicas", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--replicas or --min-replicas/--max-replicas" in done.stderr
